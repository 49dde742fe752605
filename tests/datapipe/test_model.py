"""The GPT: packed rows behave exactly like their documents run alone; padding is never attended."""

from __future__ import annotations

import pytest
import torch

from datapipe.core.config import ConfigError
from datapipe.train.model import GPT, ModelConfig, token_losses
from datapipe.loader.packing import IGNORE_INDEX

TOL = 1e-5  # fp32 on CPU: the packed and separate computations differ only by summation order


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, n_layer=2, n_head=2, d_model=32, max_seq_len=64, attention="sdpa")
    return GPT(ModelConfig(**{**cfg, **kw})).eval()


def packed_row(lengths: list[int], seq_len: int, vocab: int = 97) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """One row holding documents of `lengths` then padding, laid out as the loader does."""
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    pad = seq_len - sum(lengths)
    ids = torch.cat(docs + [torch.zeros(pad, dtype=torch.long)])
    doc_ids = torch.cat([torch.full((n,), 10 + i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)])
    labels = torch.cat([torch.cat([d[1:], torch.tensor([IGNORE_INDEX])]) for d in docs]
                       + [torch.full((pad,), IGNORE_INDEX)])
    cu = torch.tensor([0, *torch.tensor(lengths + [pad]).cumsum(0).tolist()], dtype=torch.int32)
    batch = {"input_ids": ids[None], "doc_ids": doc_ids[None], "position_ids": pos[None], "labels": labels[None],
             "cu_seqlens": cu}
    return batch, docs


@pytest.mark.parametrize("tie", [True, False])
def test_packed_row_loss_equals_each_document_alone(tie):
    model = tiny(tie_embeddings=tie)
    batch, docs = packed_row([20, 7, 25], seq_len=64)
    with torch.no_grad():
        logits = model(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=batch["doc_ids"])
        packed = token_losses(logits, batch["labels"])[0]
        start = 0
        for d in docs:
            alone = token_losses(model(d[None]), torch.cat([d[1:], torch.tensor([IGNORE_INDEX])])[None])[0]
            torch.testing.assert_close(packed[start:start + len(d)], alone, atol=TOL, rtol=TOL)
            start += len(d)
        assert packed[start:].abs().sum() == 0  # padding carries no loss


def test_padding_and_other_documents_are_never_attended():
    model = tiny()
    batch, _ = packed_row([30, 20], seq_len=64)
    other = batch["input_ids"].clone()
    other[0, 50:] = 5  # change the padding
    other[0, :30] = 3  # and the first document
    with torch.no_grad():
        a = model(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=batch["doc_ids"])
        b = model(other, position_ids=batch["position_ids"], doc_ids=batch["doc_ids"])
    torch.testing.assert_close(a[0, 30:50], b[0, 30:50], atol=TOL, rtol=TOL)  # the second document is untouched
    assert torch.isfinite(a).all()


def test_tied_embeddings_share_one_matrix_and_config_errors_name_the_field():
    m = tiny(tie_embeddings=True)
    assert m.head.weight is m.embed.weight
    assert tiny(tie_embeddings=False).num_params(non_embedding=False) == m.num_params(non_embedding=False) + 97 * 32
    with pytest.raises(ConfigError, match=r"d_model must be a multiple of n_head=3, got 32"):
        ModelConfig(vocab_size=10, n_head=3, d_model=32)
    with pytest.raises(ValueError, match="max_seq_len=64, got 65"):
        tiny()(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["flex", "varlen"])
def test_cuda_paths_match_sdpa(kind):
    batch, _ = packed_row([20, 7, 25], seq_len=64)
    batch = {k: v.cuda() for k, v in batch.items()}
    ref, fast = tiny().cuda(), tiny(attention=kind).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a = ref(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=batch["doc_ids"])
        b = fast(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=batch["doc_ids"],
                 cu_seqlens=batch["cu_seqlens"])
    real = batch["doc_ids"][0] >= 0
    torch.testing.assert_close(a[0, real], b[0, real], atol=5e-2, rtol=5e-2)  # bf16
