"""A tiny fastText classifier trained in the test with the binding: code (`__label__hq`) against the corpus slice's
other documents (`__label__cc`), DCLM's two labels."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import ASSETS


def texts(name: str) -> list[str]:
    return [json.loads(line)["text"] for line in (ASSETS / name).read_text().splitlines()]


def train(folder: Path) -> Path:
    """The model's .bin file in `folder` (seeded, one thread: the same model every time)."""
    import fasttext

    lines = [f"__label__hq {t}" for t in texts("target_code.jsonl")]
    lines += [f"__label__cc {json.loads(r)['text']}" for r in (ASSETS / "corpus_slice.jsonl").read_text().splitlines()
              if json.loads(r)["source"] != "code"]
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "train.txt"
    data.write_text("".join(line.replace("\n", " ") + "\n" for line in lines))
    model = fasttext.train_supervised(str(data), dim=16, epoch=50, lr=0.5, wordNgrams=2, thread=1, seed=0, verbose=0)
    model.save_model(str(folder / "model.bin"))
    return folder / "model.bin"
