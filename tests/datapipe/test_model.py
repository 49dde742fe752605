"""The GPT: packed rows behave exactly like their documents run alone, also when one document sits
twice in a row (attention segments are the packed pieces, not the document ids); padding is never
attended."""

from __future__ import annotations

import pytest
import torch

from datapipe.core.config import ConfigError
from datapipe.train.model import GPT, ModelConfig, token_losses
from datapipe.loader.packing import IGNORE_INDEX, segment_ids_of

TOL = 1e-5  # fp32 on CPU: the packed and separate computations differ only by summation order


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, n_layer=2, n_head=2, d_model=32, max_seq_len=64, attention="sdpa")
    return GPT(ModelConfig(**{**cfg, **kw})).eval()


def packed_row(lengths: list[int], seq_len: int, vocab: int = 97,
               doc_of: list[int] | None = None) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """One row holding documents of `lengths` then padding, laid out as the loader does.

    doc_of: the document id of each piece (default: all different); pieces with one id hold the
    same tokens, as two copies of one document drawn twice.
    """
    g = torch.Generator().manual_seed(1)
    doc_of = doc_of or list(range(len(lengths)))
    tokens = {d: torch.randint(1, vocab, (n,), generator=g) for d, n in zip(doc_of, lengths)}
    docs = [tokens[d] for d in doc_of]
    assert [len(d) for d in docs] == lengths
    pad = seq_len - sum(lengths)
    ids = torch.cat(docs + [torch.zeros(pad, dtype=torch.long)])
    doc_ids = torch.cat([torch.full((n,), 10 + d) for d, n in zip(doc_of, lengths)] + [torch.full((pad,), -1)])
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)])
    labels = torch.cat([torch.cat([d[1:], torch.tensor([IGNORE_INDEX])]) for d in docs]
                       + [torch.full((pad,), IGNORE_INDEX)])
    cu = torch.tensor([0, *torch.tensor(lengths + [pad]).cumsum(0).tolist()], dtype=torch.int32)
    batch = {"input_ids": ids[None], "doc_ids": doc_ids[None], "position_ids": pos[None], "labels": labels[None],
             "cu_seqlens": cu}
    return batch, docs


def forward(model: GPT, batch: dict, input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The model on a batch, called as the trainer calls it."""
    ids = batch["input_ids"] if input_ids is None else input_ids
    return model(ids, position_ids=batch["position_ids"], doc_ids=batch["doc_ids"], cu_seqlens=batch["cu_seqlens"])


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("doc_of", [[0, 1, 2], [0, 0, 1, 1, 1]], ids=["distinct", "repeated"])
def test_packed_row_loss_equals_each_document_alone(tie, doc_of):
    """Each piece's token losses equal its document run alone; with "repeated", the row holds
    document 0 twice then document 1 three times, side by side with equal doc_ids (a mixture
    restarting a domain's pass draws a document again): no copy may see the one before it."""
    model = tiny(tie_embeddings=tie)
    lengths = {0: 20, 1: 7, 2: 25}
    batch, docs = packed_row([lengths[d] for d in doc_of], seq_len=64, doc_of=doc_of)
    with torch.no_grad():
        logits = forward(model, batch)
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
        a = forward(model, batch)
        b = forward(model, batch, other)
    torch.testing.assert_close(a[0, 30:50], b[0, 30:50], atol=TOL, rtol=TOL)  # the second document is untouched
    assert torch.isfinite(a).all()
    # segment_ids (B, S) give the same attention as cu_seqlens; doc_ids alone cannot mark the pieces
    segs = segment_ids_of(batch["cu_seqlens"], 64)
    with torch.no_grad():
        c = model(batch["input_ids"], position_ids=batch["position_ids"], segment_ids=segs)
    torch.testing.assert_close(a, c, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"pass cu_seqlens \(or segment_ids\) with doc_ids"):
        model(batch["input_ids"], doc_ids=batch["doc_ids"])


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
@pytest.mark.parametrize("doc_of", [[0, 1, 2], [0, 0, 1, 1, 1]], ids=["distinct", "repeated"])
def test_cuda_paths_match_sdpa(kind, doc_of):
    """Every attention path uses the same segments (the packed pieces), repeated documents included."""
    lengths = {0: 20, 1: 7, 2: 25}
    batch, _ = packed_row([lengths[d] for d in doc_of], seq_len=64, doc_of=doc_of)
    batch = {k: v.cuda() for k, v in batch.items()}
    ref, fast = tiny().cuda(), tiny(attention=kind).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a = forward(ref, batch)
        b = forward(fast, batch)
    real = batch["doc_ids"][0] >= 0
    torch.testing.assert_close(a[0, real], b[0, real], atol=5e-2, rtol=5e-2)  # bf16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["flex", "varlen"])
def test_cuda_paths_give_sdpa_s_loss_and_gradients_and_never_attend_across_pieces(kind):
    """On a packed batch in bf16: the same loss and parameter gradients as sdpa within bf16 tolerance, and changing
    the first piece leaves the second piece's logits as they were."""
    batch, _ = packed_row([20, 7, 25], seq_len=64)
    batch = {k: v.cuda() for k, v in batch.items()}
    grads, losses = {}, {}
    for name in ("sdpa", kind):
        model = tiny(attention=name).cuda().train()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = token_losses(forward(model, batch).float(), batch["labels"]).sum() / (batch["labels"] >= 0).sum()
        loss.backward()
        losses[name] = float(loss)
        grads[name] = torch.cat([p.grad.flatten().float() for p in model.parameters()])
    assert abs(losses[kind] - losses["sdpa"]) < 2e-2
    cosine = torch.nn.functional.cosine_similarity(grads[kind], grads["sdpa"], dim=0)
    assert cosine > 0.99 and (grads[kind] - grads["sdpa"]).norm() < 0.1 * grads["sdpa"].norm()
    model = tiny(attention=kind).cuda()
    other = batch["input_ids"].clone()
    other[0, :20] = 3  # the first piece changed
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = forward(model, batch), forward(model, batch, other)
    torch.testing.assert_close(a[0, 20:52], b[0, 20:52], atol=0, rtol=0)  # the other pieces see none of it
