"""The fused Triton joint+loss against the plain-PyTorch joint and reference loss.

Without CUDA the kernels run on CPU tensors under the Triton interpreter (tiny shapes); with
CUDA the same cases run compiled, plus the gpu-marked evidence at MLPerf shapes (tests/conftest.py
turns the interpreter on where there is no CUDA).
"""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
import triton  # noqa: E402

from rnnt.kernels import joint_loss as jl  # noqa: E402
from rnnt.kernels import joint_loss_kernels as jk  # noqa: E402
from rnnt.loss import TransducerLoss, rnnt_loss_reference  # noqa: E402
from tests.helpers import diagonal_major, make_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(leaves, f_lens, targets, target_lens, keep=None, p=0.0, exact=False):
    """Per-utterance loss and grads (f, g, W, bias) of the plain joint + reference loss, fp32
    (fp64 if `exact`)."""
    dtype = torch.float64 if exact else torch.float32
    f, g, weight, bias = (x.detach().to(dtype).requires_grad_(True) for x in leaves)
    h = torch.relu(f.unsqueeze(2) + g.unsqueeze(1))
    if keep is not None:
        h = h * keep / (1 - p)
    logits = h @ weight.T + bias
    nll = rnnt_loss_reference(logits, targets, f_lens, target_lens, weight.shape[0] - 1)
    grads = torch.autograd.grad(nll.mean(), (f, g, weight, bias))
    return nll.detach(), grads


def fused(leaves, f_lens, targets, target_lens, p=0.0, seed=0, packed=False, one_pass=False):
    """Per-utterance loss and grads of the mean, from the fused kernels; `packed` passes the
    lengths on the host too. `one_pass` asks for the mean itself (gradients formed in the
    forward pass) and returns the per-utterance losses of a no-grad call with it."""
    vocab = leaves[2].shape[0]
    host = (f_lens.tolist(), target_lens.tolist()) if packed else None
    args = (*leaves, f_lens, targets, target_lens, vocab - 1, p, seed)
    if not one_pass:
        nll = jl.fused_joint_loss(*args, host_lens=host)
        return nll.detach(), torch.autograd.grad(nll.mean(), leaves)
    mean = jl.fused_joint_loss(*args, host_lens=host, reduction="mean")
    grads = torch.autograd.grad(mean, leaves)
    with torch.no_grad():
        nll = jl.fused_joint_loss(*args, host_lens=host)
    assert_rel(mean.detach(), nll.mean(), 1e-6, "mean of the one-pass call")
    return nll, grads


def assert_rel(got, want, rel, what):
    err = (got.float() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rel * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def assert_matches(got, want, rel):
    (nll, grads), (ref_nll, ref_grads) = got, want
    assert torch.isfinite(nll).all()
    assert_rel(nll, ref_nll, rel, "loss")
    for name, a, b in zip(("f", "g", "W", "bias"), grads, ref_grads, strict=True):
        assert torch.isfinite(a).all(), name
        assert_rel(a, b, rel, f"grad {name}")


CASES = {
    # ragged batch, V not a power of two (the row kernels mask classes), H not a power of two
    "ragged": dict(lens=[(5, 4), (3, 1), (4, 0)], u_max=4, hid=24, vocab=37),
    # T = 1 and U = 0 / 1 side by side
    "edges": dict(lens=[(1, 0), (1, 1), (2, 0)], u_max=1, hid=16, vocab=10),
    # V a power of two, like the model's 1024: the row kernels' unmasked path (V == block width)
    "power_of_two_classes": dict(lens=[(3, 2), (2, 3)], u_max=3, hid=32, vocab=64),
}


ONE_PASS = pytest.mark.parametrize("one_pass", [False, True], ids=["two_pass", "one_pass"])


@ONE_PASS
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", CASES)
def test_fused_matches_reference_without_dropout(name, packed, one_pass):
    case = make_case(**CASES[name])
    assert_matches(fused(*case, packed=packed, one_pass=one_pass), reference(*case), rel=1e-4)


def _layout(lens, t_max, u1, packed):
    host = ([t for t, _ in lens], [u for _, u in lens]) if packed else None
    return jl._Layout(host, len(lens), t_max, u1)


def lattice_rows(x, lens, packed):
    """(B, T, U+1, ...) lattice values -> one per row of the layout: the whole box, or (packed)
    each utterance's T_b x (U_b + 1) cells in order."""
    if not packed:
        return x.reshape(-1, *x.shape[3:])
    return torch.cat([x[b, :t, : u + 1].reshape(-1, *x.shape[3:]) for b, (t, u) in enumerate(lens)])


@ONE_PASS
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_chunked_lattice_and_split_label_tiles_match_the_reference(monkeypatch, packed, one_pass):
    lens = [(4, 20), (3, 17), (5, 2)]
    case = make_case(lens=lens, u_max=20, hid=16, vocab=11)
    want = reference(*case)
    monkeypatch.setattr(jl, "CHUNK_BYTES", 1)  # one utterance per chunk
    layout = _layout(lens, 5, 21, packed)
    chunks = jl._Chunks(layout, 16, 11, torch.float32, DEVICE, backward=True, partials=False)
    assert [bc for _, bc, _, _ in chunks.spans] == [1, 1, 1]
    monkeypatch.setattr(jl, "MAX_FG_U_TILE", 16)  # U+1 = 21: two label tiles, df by atomics
    # 4 rows (16 classes) per block, so the persistent row programs loop over several blocks
    monkeypatch.setattr(jl, "STATS_LAUNCH", (64, 1, 1))
    monkeypatch.setattr(jl, "DLOGITS_LAUNCH", (64, 2, 1))
    monkeypatch.setattr(jl, "HIDDEN_U_TILE", 4)  # packed: programs past U_b return at once
    assert_matches(fused(*case, packed=packed, one_pass=one_pass), want, rel=1e-4)


def test_half_precision_padding_garbage_near_the_fp16_limit_stays_out():
    # Padded rows outside the lattice get h = 0: relu(6e4 + g) there would make fp16 logits
    # overflow to inf, and inf - inf in their (unused) softmax would turn gradients into NaN.
    case = make_case(**CASES["ragged"], dtype=torch.float16)
    leaves = case[0]
    with torch.no_grad():
        for b, t_len in enumerate(case[1].tolist()):
            leaves[0][b, t_len:] = 6e4
    got = fused(*case)
    assert_matches(got, reference(*case), rel=1e-2)


@ONE_PASS
def test_half_precision_odd_joint_width(one_pass):
    # The packed half-precision math takes unit pairs as 32-bit words, which an odd H would
    # split across rows: h, its gate bits and the gradients then come from the fp32 path.
    case = make_case(lens=[(4, 3), (2, 1)], u_max=3, hid=23, vocab=12, dtype=torch.float16)
    assert_matches(fused(*case, packed=True, one_pass=one_pass), reference(*case), rel=1e-2)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_lattice_posteriors_count_every_path_s_blanks_and_labels(packed):
    # Every path through utterance b's lattice takes T_b blanks and U_b labels, so whatever the
    # probabilities the blank posteriors sum to T_b and the label ones to U_b; the kernels'
    # d(logits) rest on these.
    lens = [(5, 4), (3, 1), (1, 0), (4, 4), (5, 0)]
    bsz = len(lens)
    gen = torch.Generator().manual_seed(3)
    logits = torch.zeros(bsz, 5, 5, 2)  # class 0: the label, 1: blank
    logits[..., 1] = 3 * torch.randn(bsz, 5, 5, generator=gen)
    lp = logits.log_softmax(-1).to(DEVICE)
    f_lens = torch.tensor([t for t, _ in lens], dtype=torch.int32)
    target_lens = torch.tensor([u for _, u in lens], dtype=torch.int32)
    host = ([t for t, _ in lens], [u for _, u in lens]) if packed else None
    unused = torch.zeros(bsz, 5, 1, device=DEVICE)  # the joint's operands play no part here
    targets = torch.zeros(bsz, 4, dtype=torch.long, device=DEVICE)
    prob = jl._Problem(
        unused,
        unused,
        unused[0, :2],
        unused[0, :2, 0],
        f_lens,
        targets,
        target_lens,
        host,
        1,
        0.0,
        0,
        "cublas",
    )
    lattice = jl._Lattice(prob)
    diagonal_major(
        lattice.skew_blank, lattice.skew_label, lp[..., 1], lp[..., 0], lens, prob.layout
    )
    # two calls, as the one-pass schedule makes one per chunk of utterances
    for b0, bc in ((0, 2), (2, bsz - 2)):
        lattice.solve(b0, bc)
    weights = torch.tensor([1.0, 0.5, -2.0, 0.0, 3.0], device=DEVICE)
    occ, w_blank, w_label = (x.clone() for x in lattice.posteriors(0, bsz))
    weighted = lattice.posteriors(0, bsz, weights)
    ref = rnnt_loss_reference(
        logits, torch.zeros(bsz, 4, dtype=torch.long), f_lens.long(), target_lens.long(), blank=1
    )
    assert torch.allclose(-lattice.log_lik.cpu().float(), ref, rtol=1e-5)
    starts = prob.layout.starts
    for b, (t_len, u_len) in enumerate(lens):
        rows = slice(starts[b], starts[b + 1])
        assert w_blank[rows].sum().item() == pytest.approx(t_len, rel=1e-5)
        assert w_label[rows].sum().item() == pytest.approx(u_len, rel=1e-5)
        assert (occ[rows] <= 1 + 1e-6).all()
        if not packed:  # the box's rows outside the lattice are 0
            inside = torch.zeros(5, 5, dtype=torch.bool, device=DEVICE)
            inside[:t_len, : u_len + 1] = True
            assert (occ[rows].view(5, 5)[~inside] == 0).all()
        for got, want in zip(weighted, (occ, w_blank, w_label), strict=True):
            assert torch.allclose(got[rows], want[rows] * weights[b])
    assert torch.equal(occ, w_blank + w_label)


def test_packed_layout_holds_only_lattice_rows_and_groups_whole_utterances():
    lens = [(4, 20), (3, 17), (5, 2), (1, 0)]
    layout = _layout(lens, 5, 21, packed=True)
    assert layout.packed and layout.n_rows == 154
    assert layout.starts == [0, 84, 138, 153, 154]  # T_b (U_b + 1) rows each
    assert layout.chunks(100) == [(0, 1), (1, 3)]  # 54 + 15 + 1 rows fit in 100
    assert layout.chunks(10) == [(0, 1), (1, 1), (2, 1), (3, 1)]  # oversize: one per chunk
    padded = _layout(lens, 5, 21, packed=False)
    assert not padded.packed and padded.starts == [0, 105, 210, 315, 420]
    full = _layout([(5, 20)] * 4, 5, 21, packed=True)
    assert not full.packed  # no padding to skip: the padded kernels, which read no offsets


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_hidden_kernel_fills_each_row_s_h_and_target_label(monkeypatch, packed):
    # The row each lattice cell lands on, in both layouts and across chunks starting mid-batch:
    # h as `joint_hidden` gives it for the cell, and the target label targets[b, u] clamped to
    # [0, V) for u < U_b (0 elsewhere), which the stats and d(logits) kernels gather by row.
    lens = [(4, 3), (2, 0), (3, 4), (1, 1)]
    leaves, f_lens, targets, target_lens = make_case(lens, 4, 24, 37)
    targets[0, 1], targets[2, 0] = -5, 99  # out of range: clamped
    host = ([t for t, _ in lens], [u for _, u in lens]) if packed else None
    # 18 rows per chunk (h, dh, logits, gate bytes)
    monkeypatch.setattr(jl, "CHUNK_BYTES", 18 * (24 * 4 * 2 + 37 * 4 + 4))
    leaves = [x.detach() for x in leaves]
    prob = jl._Problem(*leaves, f_lens, targets, target_lens, host, 36, 0.3, 5, "cublas")
    chunks = prob.chunks(backward=True, stats=True)
    assert len(chunks.spans) >= 2  # later chunks start mid-batch
    rows = torch.zeros(prob.layout.n_rows, 24, device=DEVICE)
    gates = torch.zeros(prob.layout.n_rows, 4, dtype=torch.uint8, device=DEVICE)
    for chunk in chunks:
        prob.logits(chunk)
        rows[chunk.row0 : chunk.row0 + chunk.n] = chunk.h
        gates[chunk.row0 : chunk.row0 + chunk.n] = chunk.gates
    want_h = jl.joint_hidden(*leaves[:2], f_lens, target_lens, 0.3, 5)
    assert torch.equal(rows, lattice_rows(want_h, lens, packed))
    # gate bits, units 0-31 (H = 24 padded to 32): bit k % 8 of byte k // 8 is h != 0
    open_ = F.pad(rows != 0, (0, 8)).view(-1, 4, 8).to(torch.uint8)
    want_gates = (open_ << torch.arange(8, dtype=torch.uint8, device=DEVICE)).sum(-1)
    assert 0 < int((rows != 0).sum()) < rows.numel()  # dropout and ReLU both close some gates
    assert torch.equal(gates, want_gates.to(torch.uint8))
    u = torch.arange(5, device=DEVICE)
    want = torch.where(u < target_lens[:, None], F.pad(targets.clamp(0, 36), (0, 1)), 0)
    want_labels = want[:, None, :].expand(4, 4, 5)
    assert prob.label_rows.tolist() == lattice_rows(want_labels, lens, packed).tolist()


def test_packed_and_padded_rows_give_the_same_loss_with_dropout(monkeypatch):
    # Same hash of (b, t, u, k) in both layouts: identical masks, so equal up to rounding;
    # small chunks so that packed chunks start mid-batch.
    monkeypatch.setattr(jl, "CHUNK_BYTES", 4000)
    case = make_case(**CASES["ragged"])
    padded = fused(*case, p=0.3, seed=7)
    packed = fused(*case, p=0.3, seed=7, packed=True)
    assert_matches(packed, padded, rel=1e-5)


def test_packed_host_lengths_are_checked_against_the_shapes():
    leaves, f_lens, targets, target_lens = make_case(**CASES["ragged"])  # T 5, U 4
    for host, match in [
        (([5, 3], [4, 1]), "expected 3 frame and 3 label lengths"),
        (([6, 3, 4], [4, 1, 0]), r"utterance 0 has \(T, U\) = \(6, 4\)"),
        (([5, 3, 4], [4, 5, 0]), r"utterance 1 has \(T, U\) = \(3, 5\)"),
        (([5, 0, 4], [4, 1, 0]), "utterance 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            jl.fused_joint_loss(*leaves, f_lens, targets, target_lens, 36, host_lens=host)


def test_per_utterance_output_gradients_are_honoured():
    # Not a uniform 1/B: the kernels scale by go_b / max|go|, including a zero and a negative.
    leaves, f_lens, targets, target_lens = make_case(**CASES["ragged"])
    weights = torch.tensor([0.5, 0.0, -2.0], device=DEVICE)
    nll = jl.fused_joint_loss(*leaves, f_lens, targets, target_lens, 36)
    got = torch.autograd.grad((nll * weights).sum(), leaves)
    ref_leaves = [x.detach().float().requires_grad_(True) for x in leaves]
    f, g, weight, bias = ref_leaves
    logits = torch.relu(f.unsqueeze(2) + g.unsqueeze(1)) @ weight.T + bias
    ref = rnnt_loss_reference(logits, targets, f_lens, target_lens, 36)
    want = torch.autograd.grad((ref * weights).sum(), ref_leaves)
    for name, a, b in zip(("f", "g", "W", "bias"), got, want, strict=True):
        assert_rel(a, b, 1e-4, f"grad {name}")


def test_host_lengths_that_do_not_fit_the_inputs_are_rejected():
    leaves, f_lens, targets, target_lens = make_case(**CASES["ragged"])
    bsz, t_max, _ = leaves[0].shape
    t_lens, u_lens = f_lens.tolist(), target_lens.tolist()
    t_lens[1] = t_max + 1
    with pytest.raises(ValueError, match=rf"host_lens: utterance 1 has \(T, U\) = \({t_max + 1},"):
        jl.fused_joint_loss(*leaves, f_lens, targets, target_lens, 36, host_lens=(t_lens, u_lens))


def test_one_pass_sum_scales_its_gradients_by_the_output_gradient():
    # The one-pass schedule forms the gradients before the output gradient exists and scales
    # them in backward: 'sum' times 2.5 must give 2.5 times the reference sum's gradients.
    leaves, f_lens, targets, target_lens = make_case(**CASES["ragged"])
    total = jl.fused_joint_loss(*leaves, f_lens, targets, target_lens, 36, reduction="sum")
    assert total.dim() == 0
    got = torch.autograd.grad(total * 2.5, leaves)
    ref_nll, ref_grads = reference(leaves, f_lens, targets, target_lens)
    assert_rel(total.detach(), ref_nll.sum(), 1e-5, "sum")
    for name, a, b in zip(("f", "g", "W", "bias"), got, ref_grads, strict=True):
        assert_rel(a, b * 2.5 * len(ref_nll), 1e-4, f"grad {name}")  # ref_grads: of the mean
    with pytest.raises(ValueError, match="reduction must be one of"):
        jl.fused_joint_loss(*leaves, f_lens, targets, target_lens, 36, reduction="avg")


@ONE_PASS
def test_fused_matches_reference_with_the_same_dropout_mask(one_pass):
    p, seed = 0.3, 1234
    leaves, f_lens, targets, target_lens = case = make_case(**CASES["ragged"])
    bsz, t_max, hid = leaves[0].shape
    keep = jl.dropout_keep_mask(seed, bsz, t_max, leaves[1].shape[1], hid, p, DEVICE)
    assert 0.5 < keep.float().mean().item() < 0.9  # about 1 - p of the units survive
    got = fused(*case, p=p, seed=seed, one_pass=one_pass)
    assert_matches(got, reference(*case, keep=keep, p=p), rel=1e-4)
    # the mask is really used: without it the loss differs
    assert (got[0] - reference(*case)[0]).abs().max() > 1e-3


def test_dropout_mask_has_the_drop_rate_and_independent_unit_pairs():
    # One hash serves units 2j and 2j + 1 (15 bits of each half): both must be kept at
    # rate 1 - p, and independently of each other and of the neighbouring pair.
    p = 0.3
    keep = jl.dropout_keep_mask(5, 2, 8, 9, 512, p, DEVICE).float()
    assert keep.mean().item() == pytest.approx(1 - p, abs=0.005)
    even, odd = keep[..., 0::2], keep[..., 1::2]
    assert even.mean().item() == pytest.approx(1 - p, abs=0.007)
    assert odd.mean().item() == pytest.approx(1 - p, abs=0.007)
    assert (even * odd).mean().item() == pytest.approx((1 - p) ** 2, abs=0.007)
    assert (odd[..., :-1] * even[..., 1:]).mean().item() == pytest.approx((1 - p) ** 2, abs=0.007)
    # different cells and utterances draw different masks
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])
    assert not torch.equal(keep[0, 0, 0], keep[1, 0, 0])


def hidden_oracle(f, g, f_lens, target_lens, keep, exact=torch.float32):
    """keep * relu(f + g) of the padded lattice, 0 past the lengths, the sum taken in `exact`
    and rounded once to f's dtype."""
    h = torch.relu(f.to(exact).unsqueeze(2) + g.to(exact).unsqueeze(1)) * keep
    t = torch.arange(f.shape[1], device=f.device)[:, None]
    u = torch.arange(g.shape[1], device=f.device)[None, :]
    inside = (t < f_lens.view(-1, 1, 1)) & (u <= target_lens.view(-1, 1, 1))
    return (h * inside.unsqueeze(-1)).to(f.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_hidden_rows_are_the_masked_relu_of_f_plus_g(dtype):
    # what the GEMMs read: keep * relu(f + g) exactly (1 / (1 - p) is applied later in fp32),
    # and zero rows past each utterance's lengths (garbage padding included)
    (f, g, *_), f_lens, _, target_lens = make_case(**CASES["ragged"], dtype=dtype)
    f, g = f.detach(), g.detach()
    p, seed = 0.3, 77
    keep = jl.dropout_keep_mask(seed, *f.shape[:2], g.shape[1], f.shape[2], p, DEVICE)
    h = jl.joint_hidden(f, g, f_lens, target_lens, p, seed, packed_math=False)
    assert torch.equal(h, hidden_oracle(f, g, f_lens, target_lens, keep))
    assert (h == 0).float().mean() > 0.5  # dropped, negative and padded units all appear
    no_dropout = jl.joint_hidden(f, g, f_lens, target_lens, 0.0, seed, packed_math=False)
    assert torch.equal(no_dropout, hidden_oracle(f, g, f_lens, target_lens, 1.0))


@pytest.mark.parametrize("vocab", [384, 1024], ids=["3_tiles", "8_tiles"])
def test_stats_from_gemm_partials_equal_the_stats_kernel_s(vocab):
    # The sm90 GEMM's epilogue hands over per 128-class tile (max, sum exp2(x - max)) of the
    # base-2 logits x; merged, they must give what the one-pass stats kernel gives from the
    # logits themselves (and the log-softmax of the biased, scaled logits). The partials here
    # come from a plain-PyTorch oracle, as the GEMM's are checked against it on the GPU.
    n, gate_scale, blank = 37, 1 / 0.7, vocab - 1
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(n, vocab, generator=gen) * 4).half().to(DEVICE)
    bias = (torch.randn(vocab, generator=gen)).half().to(DEVICE)
    labels = torch.randint(0, vocab, (n + 5,), generator=gen, dtype=torch.int32).to(DEVICE)
    x = logits.double() * gate_scale * jk.LOG2E.value + bias.double() * jk.LOG2E.value
    tiles = x.view(n, -1, 128)
    top = tiles.amax(-1)
    part = torch.stack([top, torch.exp2(tiles - top[..., None]).sum(-1)], -1).float()
    row0 = 5  # the chunk's rows start at batch row 5
    # each row's log-probabilities go to its cell (blank) and the next (label): here reversed
    dest = (2 * torch.arange(n + row0, 0, -1, dtype=torch.int32)).to(DEVICE)
    outs = {}
    for name in ("partials", "stats"):
        lse = torch.full((n + row0,), 9.0, device=DEVICE)
        skb, skl = torch.full((2, 2 * (n + row0) + 2), 9.0, device=DEVICE)
        if name == "partials":
            jk.stats_from_partials_kernel[(triton.cdiv(n, 16),)](
                part,
                logits,
                bias,
                labels,
                dest,
                lse,
                skb,
                skl,
                row0,
                n,
                vocab,
                blank,
                gate_scale,
                NT=vocab // 128,
                NTP=triton.next_power_of_2(vocab // 128),
                BR=16,
            )
        else:
            jk.logit_stats_kernel[(2,)](
                logits,
                bias,
                labels,
                dest,
                lse,
                skb,
                skl,
                row0,
                n,
                vocab,
                blank,
                gate_scale,
                BR=4,
                BN=triton.next_power_of_2(vocab),
                EVEN=vocab == 1024,
                STAGES=1,
            )
        assert (lse[:row0] == 9.0).all(), "rows before the chunk untouched"
        mine = dest[row0:].long()
        assert (skb[dest[:row0].long()] == 9.0).all() and (skb[mine + 1] == 9.0).all()
        outs[name] = torch.stack([lse[row0:], skb[mine], skl[mine + 1]])
    torch.testing.assert_close(outs["partials"], outs["stats"], rtol=0, atol=2e-5)
    logp = torch.log_softmax(logits.double() * gate_scale + bias.double(), -1)
    want = [logp[:, blank], logp.gather(1, labels[row0:].long()[:, None])[:, 0]]
    torch.testing.assert_close(outs["partials"][1:].double(), torch.stack(want), rtol=0, atol=2e-5)


def test_dropout_is_reproducible_from_the_seed():
    case = make_case(**CASES["edges"])
    a = fused(*case, p=0.5, seed=3)[0]
    b = fused(*case, p=0.5, seed=3)[0]
    c = fused(*case, p=0.5, seed=4)[0]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_transducer_loss_fused_backend_equals_reference_backend():
    from rnnt.config import ModelConfig
    from rnnt.model import Joint

    torch.manual_seed(0)
    (f, g, _, _), f_lens, targets, target_lens = make_case(**CASES["ragged"])
    joint = Joint(ModelConfig(joint_n_hid=24, n_classes=37, joint_dropout=0.3)).to(DEVICE)
    joint.eval()  # dropout off: both backends see the same joint
    args = (joint, f, g, f_lens, targets, target_lens)
    got = TransducerLoss("fused", 36)(*args)
    got_grads = torch.autograd.grad(got, (f, g, joint.fc.weight, joint.fc.bias))
    want = TransducerLoss("reference", 36)(*args)
    want_grads = torch.autograd.grad(want, (f, g, joint.fc.weight, joint.fc.bias))
    assert_rel(got.detach(), want.detach(), 1e-4, "loss")
    for a, b in zip(got_grads, want_grads, strict=True):
        assert_rel(a, b, 1e-4, "grad")


def test_fused_on_cpu_tensors_without_the_interpreter_names_the_cpu_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    leaves, f_lens, targets, target_lens = make_case(**CASES["edges"], device="cpu")
    with pytest.raises(RuntimeError, match="loss.backend=reference on CPU"):
        jl.fused_joint_loss(*leaves, f_lens, targets, target_lens, blank=9)


def test_fused_rejects_mixed_dtypes_bad_dropout_and_short_targets():
    leaves, f_lens, targets, target_lens = make_case(**CASES["edges"])
    with pytest.raises(TypeError, match="one dtype"):
        jl.fused_joint_loss(leaves[0].double(), *leaves[1:], f_lens, targets, target_lens, blank=9)
    with pytest.raises(ValueError, match="dropout probability"):
        jl.fused_joint_loss(*leaves, f_lens, targets, target_lens, blank=9, dropout_p=1.0)
    # the kernels read targets[b, u] for u < U_b: a narrower targets tensor must not get there
    with pytest.raises(ValueError, match=r"targets must be \(B, U\) = \(3, 1\)"):
        jl.fused_joint_loss(*leaves, f_lens, targets[:, :0], target_lens, blank=9)


# --------------------------------------------------------------------------------------------
# GPU evidence (compiled kernels, MLPerf-sized shapes)


def random_lens(bsz, t_max, u_max, seed):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(max(1, t_max // 2), t_max + 1, (bsz,), generator=gen)
    u = torch.randint(0, u_max + 1, (bsz,), generator=gen)
    t[0], u[0] = t_max, u_max
    return list(zip(t.tolist(), u.tolist(), strict=True))


@pytest.mark.gpu
@ONE_PASS
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("bsz", [1, 7, 64])
def test_gpu_fp32_matches_reference_on_ragged_batches(bsz, packed, one_pass):
    case = make_case(random_lens(bsz, 40, 12, bsz), 12, 512, 1024, seed=bsz)
    assert_matches(fused(*case, packed=packed, one_pass=one_pass), reference(*case), rel=1e-4)


@pytest.mark.gpu
@ONE_PASS
def test_gpu_fp32_vocabulary_not_a_power_of_two(one_pass):
    # the row kernels' masked-class path with their pipelined loads (the CPU interpreter runs
    # the loops unpipelined, and the other GPU cases have V = 1024, the unmasked path)
    case = make_case(random_lens(7, 40, 12, 3), 12, 512, 1000, seed=3)
    assert_matches(fused(*case, packed=True, one_pass=one_pass), reference(*case), rel=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_gpu_one_pass_over_many_chunks_matches_the_reference(monkeypatch, packed):
    # the one-pass schedule chunk after chunk in reused buffers, compiled (the CPU cases run
    # the same under the interpreter, with tiny shapes)
    lens = random_lens(64, 40, 12, 6)
    case = make_case(lens, 12, 512, 1024, seed=6)
    monkeypatch.setattr(jl, "CHUNK_BYTES", 4 << 20)  # about 500 rows per chunk
    layout = _layout(lens, 40, 13, packed)
    assert len(jl._Chunks(layout, 512, 1024, torch.float32, DEVICE, True, False).spans) >= 30
    assert_matches(fused(*case, packed=packed, one_pass=True), reference(*case), rel=1e-4)


@pytest.mark.gpu
def test_gpu_fp32_long_lattices_within_1e5_of_an_fp64_reference():
    # -log P reaches 700 here: alpha and beta walked in fp32 put 1.5e-4 relative errors into
    # the posteriors exp(alpha + lp + beta - log P) (the fp32 reference itself is 4e-5 off);
    # walked in fp64 the gradients are within 4e-6
    case = make_case(random_lens(48, 60, 20, 5), 20, 512, 1024, seed=5)
    assert_matches(fused(*case, packed=True, one_pass=True), reference(*case, exact=True), 1e-5)


@pytest.mark.gpu
@ONE_PASS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_half_precision_within_1e2_of_fp32(dtype, one_pass):
    # fp32 run on the same (rounded) values: rounding the inputs differently would flip ReLUs
    # of pre-activations near 0 and compare two different functions.
    leaves, *rest = make_case(random_lens(16, 60, 20, 1), 20, 512, 1024, dtype=dtype)
    leaves32 = [x.detach().float().requires_grad_(True) for x in leaves]
    got = fused(leaves, *rest, one_pass=one_pass)
    rel = 1e-2 if dtype == torch.float16 else 3e-2
    assert_matches(got, fused(leaves32, *rest), rel=rel)
    assert_matches(got, reference(leaves, *rest), rel=rel)


@pytest.mark.gpu
def test_gpu_dropout_matches_reference_with_the_same_mask():
    p, seed = 0.3, 99
    leaves, *rest = case = make_case(random_lens(4, 30, 10, 2), 10, 512, 1024)
    keep = jl.dropout_keep_mask(seed, 4, 30, 11, 512, p, DEVICE)
    assert_matches(fused(*case, p=p, seed=seed), reference(*case, keep=keep, p=p), rel=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_packed_half_precision_hidden_rows_are_exact(dtype, p):
    # The inline-assembly path (pairs of units in packed math, the mask by one subtraction):
    # the same mask as `_keep`, and the sum rounded once (the fp64 sum of two half-precision
    # numbers is exact).
    lens = random_lens(5, 40, 12, 4)
    (f, g, *_), f_lens, _, target_lens = make_case(lens, 12, 512, 1024, dtype=dtype, seed=4)
    f, g = f.detach(), g.detach()
    keep = jl.dropout_keep_mask(11, *f.shape[:2], g.shape[1], 512, p, DEVICE)
    h = jl.joint_hidden(f, g, f_lens, target_lens, p, 11)
    assert torch.equal(h, hidden_oracle(f, g, f_lens, target_lens, keep, exact=torch.float64))
    fp32_math = jl.joint_hidden(f, g, f_lens, target_lens, p, 11, packed_math=False)
    assert torch.equal(h != 0, fp32_math != 0)


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_longest_mlperf_shape_and_batch_512():
    # (192, 279, 125) has 4.3e9 logits (> 2^31): the padded joint cannot even be indexed.
    for bsz, t_max, u_max in ((192, 279, 125), (512, 60, 20)):
        lens = [(t_max, u_max)] * bsz
        leaves, *rest = make_case(lens, u_max, 512, 1024, dtype=torch.float16, seed=bsz)
        nll, grads = fused(leaves, *rest, one_pass=True)
        assert torch.isfinite(nll).all() and all(torch.isfinite(x).all() for x in grads)
        # every utterance is the same shape but different data: per-utterance losses differ
        assert nll.std() > 0
        # the first utterance alone gives the same loss and gradient
        one = [x.detach()[:1].clone().requires_grad_(True) for x in leaves[:2]] + [
            x.detach().clone().requires_grad_(True) for x in leaves[2:]
        ]
        nll1, grads1 = fused(one, *(x[:1] for x in rest), one_pass=True)
        assert_rel(nll1, nll[:1], 2e-3, "loss of utterance 0")
        assert_rel(grads1[0][0] / bsz, grads[0][0], 2e-2, "grad f of utterance 0")


@pytest.mark.gpu
def test_gpu_memory_at_192_204_44_fp16(record_property):
    """At most 2 GB beyond the inputs; the time target is bench/joint_loss.py's to report."""
    bsz, t_max, u_max = 192, 204, 44
    leaves, f_lens, targets, target_lens = make_case(
        [(t_max, u_max)] * bsz, u_max, 512, 1024, dtype=torch.float16
    )

    def step():  # as the trainer calls it: the mean, dropout 0.3, gradients in one pass
        loss = jl.fused_joint_loss(
            *leaves, f_lens, targets, target_lens, 1023, 0.3, reduction="mean"
        )
        torch.autograd.grad(loss, leaves)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    record_property("extra_gib", extra / 2**30)
    assert extra <= 2e9


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.gpu
@ONE_PASS
def test_gpu_fused_loss_on_another_device_leaves_the_current_device_alone(one_pass):
    # Triton launches on the current device and the CUDA C++ launchers call cudaSetDevice, which
    # PyTorch reads back: without the loss's device guard its kernels would miss their tensors,
    # or later allocations would land on the loss's device.
    torch.cuda.set_device(0)
    case = make_case([(30, 12), (17, 5)], 12, 64, 128, dtype=torch.float16, device="cuda:1")
    prob = jl._Problem(*case[0], *case[1:], ([30, 17], [12, 5]), 127, 0.0, 0, "auto")
    assert prob.cuda_walk and prob.sm90 == (torch.cuda.get_device_capability(1) >= (9, 0))
    got = fused(*case, packed=True, one_pass=one_pass)
    assert torch.cuda.current_device() == 0
    assert torch.empty(1, device="cuda").device.index == 0
    assert_matches(got, reference(*case), rel=1e-2)
