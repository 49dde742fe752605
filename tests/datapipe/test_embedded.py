"""The embedded corpus of `datapipe run`: where it is cached."""

from pathlib import Path

from datapipe.curation import embedded

REPO = Path(__file__).resolve().parents[2]


def test_the_corpus_cache_is_under_datapipe_cache_dir_as_the_readme_says(tmp_path, monkeypatch):
    monkeypatch.setenv("DATAPIPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.cache_dir() == tmp_path / "cache" / "embedded"
    monkeypatch.delenv("DATAPIPE_CACHE_DIR")
    assert embedded.cache_dir() == tmp_path / "xdg" / "datapipe" / "embedded"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert embedded.cache_dir() == tmp_path / "home" / ".cache" / "datapipe" / "embedded"
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "`$DATAPIPE_CACHE_DIR/embedded`" in readme
