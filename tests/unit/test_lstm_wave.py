"""The wave LSTM (rnnt/kernels/lstm_wave.py): its dropout hash, its plain-PyTorch oracle against
nn.LSTM, the kernels' contract in plain PyTorch against the oracle, the model switch, and (on a
Hopper GPU) the CUDA kernels against both."""

import ctypes

import pytest
import torch
from torch import nn

from rnnt.config import ConfigError
from rnnt.kernels import cuda_build, lstm_wave
from rnnt.kernels.lstm_wave import keep_mask, lstm_stack, stack_reference
from rnnt.model import RNNT, StackTime, resolve_eval_encoder_lstm
from tests.helpers import tiny_cfg

F64 = torch.float64


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not hopper(), reason="needs a Hopper GPU (sm_90)")


def random_stack(k_in, hidden, n_layers, dtype=F64, device="cpu", scale=0.3, grad=True):
    gen = torch.Generator().manual_seed(7)
    layers = []
    for index in range(n_layers):
        shapes = ((4 * hidden, k_in if index == 0 else hidden), (4 * hidden, hidden))
        shapes += ((4 * hidden,), (4 * hidden,))
        layers.append(
            tuple(
                (torch.randn(*s, generator=gen, dtype=F64) * scale)
                .to(device, dtype)
                .requires_grad_(grad)
                for s in shapes
            )
        )
    return layers


def seed_tensor(value, device="cpu"):
    return torch.tensor([value], dtype=torch.int32, device=device)


def flat(layers):
    return [t for weights in layers for t in weights]


# ----------------------------------------------------------------------------------------------
# dropout keys


def mix_python(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_hash_is_exact_32_bit_arithmetic():
    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF, 123456789]
    values += torch.randint(0, 2**32, (200,), dtype=torch.int64).tolist()
    got = lstm_wave.mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [mix_python(v) for v in values]


def test_keep_mask_follows_the_key_recipe():
    """Element (t, b, u) of layer l: 16 bits of mix(step ^ ((b >> 1) H + u)), low bits for even
    rows, with step = mix(mix(seed + golden (l + 1)) + 0x85ebca6b (t + 1))."""
    seed, layer, hidden, p = 987654321, 1, 64, 0.25
    mask = keep_mask(seed_tensor(seed), layer, 4, 6, hidden, p)
    threshold = lstm_wave.drop_threshold(p)
    assert threshold == 16384
    for t, b, u in ((0, 0, 0), (3, 5, 63), (2, 1, 17), (1, 4, 40)):
        layer_seed = mix_python((seed + 0x9E3779B9 * (layer + 1)) & 0xFFFFFFFF)
        step = mix_python((layer_seed + 0x85EBCA6B * (t + 1)) & 0xFFFFFFFF)
        key = mix_python(step ^ ((b >> 1) * hidden + u))
        bits = key >> 16 if b % 2 else key & 0xFFFF
        assert bool(mask[t, b, u]) == (bits >= threshold)


def test_keep_mask_rate_independence_and_batch_invariance():
    seed = seed_tensor(1234)
    mask = keep_mask(seed, 0, 60, 64, 256, 0.1)
    assert abs((~mask).float().mean().item() - 0.1) < 0.004
    # the two rows of a key pair use different bits: they agree as often as independent draws
    agree = (mask[:, 0::2] == mask[:, 1::2]).float().mean().item()
    assert abs(agree - (0.9**2 + 0.1**2)) < 0.01
    # a smaller batch is a prefix: padding the batch leaves the real rows' masks alone
    assert torch.equal(keep_mask(seed, 0, 60, 10, 256, 0.1), mask[:, :10])
    # layers, seeds and steps draw different masks
    assert not torch.equal(keep_mask(seed, 1, 60, 64, 256, 0.1), mask)
    assert not torch.equal(keep_mask(seed_tensor(1235), 0, 60, 64, 256, 0.1), mask)
    assert not torch.equal(mask[0], mask[1])
    assert keep_mask(seed, 0, 3, 4, 8, 0.0).all()


def test_the_threshold_rounds_p_as_the_kernels_float32():
    assert lstm_wave.drop_threshold(0.1) == 6554  # 0.1f * 65536 = 6553.6001
    assert lstm_wave.drop_threshold(0.3) == 19661
    assert lstm_wave.drop_threshold(0.0) == 0


# ----------------------------------------------------------------------------------------------
# the oracle against nn.LSTM


def nn_lstm_stack(x, layers, masks, p):
    """Per-layer nn.LSTM (float64) with the given keep masks after every layer."""
    y = x
    modules = []
    for weights in layers:
        lstm = nn.LSTM(weights[0].shape[1], weights[1].shape[1]).double()
        with torch.no_grad():
            for name, value in zip(("weight_ih", "weight_hh", "bias_ih", "bias_hh"), weights):
                getattr(lstm, f"{name}_l0").copy_(value)
        y, _ = lstm(y)
        if masks is not None:
            y = y * masks[len(modules)] / (1 - p)
        modules.append(lstm)
    return y, modules


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_the_reference_is_nn_lstm_with_the_hash_masks(p):
    steps, batch, k_in, hidden, n_layers = 9, 4, 8, 16, 3
    layers = random_stack(k_in, hidden, n_layers)
    x = torch.randn(steps, batch, k_in, dtype=F64, requires_grad=True)
    seed = seed_tensor(55)
    dy = torch.randn(steps, batch, hidden, dtype=F64)
    y = stack_reference(x, layers, p, seed)
    grads = torch.autograd.grad(y, [x, *flat(layers)], dy)
    masks = [keep_mask(seed, i, steps, batch, hidden, p).double() for i in range(n_layers)]
    x2 = x.detach().clone().requires_grad_(True)
    y2, modules = nn_lstm_stack(x2, [tuple(t.detach() for t in w) for w in layers], masks, p)
    y2.backward(dy)
    assert torch.allclose(y, y2, atol=1e-12, rtol=0)
    assert torch.allclose(grads[0], x2.grad, atol=1e-12, rtol=0)
    for index, lstm in enumerate(modules):
        got = grads[1 + 4 * index : 5 + 4 * index]
        want = [
            getattr(lstm, f"{n}_l0").grad for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        ]
        for g, w in zip(got, want):
            assert torch.allclose(g, w, atol=1e-12, rtol=0)
    if p:
        dropped = [(~keep_mask(seed, i, steps, batch, hidden, p)).float().mean() for i in range(3)]
        assert all(0.15 < d < 0.45 for d in dropped)


# ----------------------------------------------------------------------------------------------
# the kernels' contract (TorchKernels through the autograd Function) against the oracle


@pytest.mark.parametrize(
    "steps,batch,k_in,hidden,n_layers,p",
    [
        (7, 5, 12, 32, 3, 0.3),
        (5, 192, 128, 32, 2, 0.1),
        (1, 3, 40, 64, 1, 0.0),
        (6, 2, 32, 32, 2, 0.0),
        (3, 4, 64, 128, 2, 0.2),
    ],
)
def test_the_factor_backward_equals_autograd_of_the_reference(
    steps, batch, k_in, hidden, n_layers, p
):
    """y, dx and every parameter's gradient; batches and inputs that need padding included.
    Inputs wider than the hidden size (after padding to 64) take the hoisted x W_ih^T path; the
    last shape does not."""
    layers = random_stack(k_in, hidden, n_layers)
    x = torch.randn(steps, batch, k_in, dtype=F64, requires_grad=True)
    seed = seed_tensor(4321)
    dy = torch.randn(steps, batch, hidden, dtype=F64)
    y = lstm_stack(x, layers, p, seed)
    assert y.shape == (steps, batch, hidden)
    got = torch.autograd.grad(y, [x, *flat(layers)], dy)
    y_ref = stack_reference(x, layers, p, seed)
    want = torch.autograd.grad(y_ref, [x, *flat(layers)], dy)
    assert (y - y_ref).abs().max() < 1e-12
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert (g - w).abs().max() < 1e-11


@pytest.mark.parametrize(
    "k_in,hidden,longest", [(12, 32, 4), (128, 32, 1), (64, 128, 6), (64, 128, 0)]
)
def test_steps_past_the_longest_length_are_skipped_with_zero_outputs(k_in, hidden, longest):
    """What a CUDA-graph bucket longer than the batch runs: the stack over the longest length
    alone, zeros after it, and no gradient from the padding (dy there is not read)."""
    steps, batch, n_layers, p = 6, 5, 3, 0.2
    layers = random_stack(k_in, hidden, n_layers)
    x = torch.randn(steps, batch, k_in, dtype=F64, requires_grad=True)
    seed = seed_tensor(99)
    lengths = torch.tensor([longest, 1, longest, 0, 1]).clamp(max=longest)
    dy = torch.randn(steps, batch, hidden, dtype=F64)
    y = lstm_stack(x, layers, p, seed, lengths=lengths)
    got = torch.autograd.grad(y, [x, *flat(layers)], dy)
    assert torch.equal(y[longest:], torch.zeros_like(y[longest:]))
    assert torch.equal(got[0][longest:], torch.zeros_like(got[0][longest:]))
    if longest == 0:
        assert all(torch.equal(g, torch.zeros_like(g)) for g in got)
        return
    y_ref = stack_reference(x[:longest], layers, p, seed)
    want = torch.autograd.grad(y_ref, [x, *flat(layers)], dy[:longest])
    assert (y[:longest] - y_ref).abs().max() < 1e-12
    for g, w in zip(got, want):
        assert (g - w).abs().max() < 1e-11
    # the full length is the stack without padding
    full = lstm_stack(x, layers, p, seed, lengths=torch.full((batch,), steps))
    assert torch.equal(full, lstm_stack(x, layers, p, seed))


@pytest.mark.parametrize(
    "steps,batch,k_in,n_layers,longest",
    [(7, 5, 12, 2, 7), (6, 3, 128, 3, 6), (9, 4, 64, 1, 6), (4, 2, 12, 2, 0)],
    ids=["odd", "even-hoisted", "padding-steps", "all-padding"],
)
def test_stack_pairs_are_stack_time_of_the_stack(steps, batch, k_in, n_layers, longest):
    """The kernels' frame-pair output is StackTime(2) of the plain output, bit for bit, forward
    and backward: each row's frames at and past its length zero (the gradient there unread),
    an odd T's last pair completed with zeros; with bucket padding steps and a padded batch."""
    hidden, p = 32, 0.2
    layers = random_stack(k_in, hidden, n_layers)
    x = torch.randn(steps, batch, k_in, dtype=F64, requires_grad=True)
    lengths = torch.randint(0, longest + 1, (batch,))
    lengths[0] = longest
    seed = seed_tensor(21)
    stacked = lstm_stack(x, layers, p, seed, lengths=lengths, stack_pairs=True)
    want, _ = StackTime(2)(lstm_stack(x, layers, p, seed, lengths=lengths), lengths)
    assert stacked.shape == want.shape == (-(-steps // 2), batch, 2 * hidden)
    assert torch.equal(stacked, want)
    dy = torch.randn(want.shape, dtype=F64)
    params = [x, *flat(layers)]
    got = torch.autograd.grad(stacked, params, dy)
    for g, w in zip(got, torch.autograd.grad(want, params, dy)):
        assert torch.equal(g, w)
    if longest:
        assert stacked.abs().sum() > 0 and got[0].abs().sum() > 0


def test_stack_pairs_need_lengths():
    layers = random_stack(12, 32, 1)
    with pytest.raises(ValueError, match="stack_pairs zeroes each row's padding and needs"):
        lstm_stack(torch.randn(3, 5, 12, dtype=F64), layers, 0.0, stack_pairs=True)


class RecordedKernels(lstm_wave.TorchKernels):
    """TorchKernels that note whether each forward was given factor planes to write."""

    def __init__(self):
        self.factors_given = []

    def forward(self, x, hseq, yseq, cstate, factors, *args):
        self.factors_given.append(factors is not None)
        super().forward(x, hseq, yseq, cstate, factors, *args)


def test_scoring_writes_no_factor_planes_and_gives_the_same_outputs():
    """Without a backward to follow (no_grad, or nothing that needs a gradient) the forward
    gets no factor planes, six values a cell that only the backward reads."""
    steps, batch, k_in, hidden = 5, 4, 12, 32
    layers = random_stack(k_in, hidden, 2)
    x = torch.randn(steps, batch, k_in, dtype=F64)
    kernels = RecordedKernels()
    trained = lstm_stack(x, layers, 0.2, seed_tensor(3), kernels)
    with torch.no_grad():
        scored = lstm_stack(x, layers, 0.2, seed_tensor(3), kernels)
    frozen = [tuple(t.detach() for t in w) for w in layers]
    unused = lstm_stack(x, frozen, 0.2, seed_tensor(3), kernels)
    assert kernels.factors_given == [True, False, False]
    assert torch.equal(scored, trained.detach()) and torch.equal(unused, scored)


def test_lengths_that_are_not_one_per_batch_row_are_refused():
    layers = random_stack(12, 32, 1)
    with pytest.raises(ValueError, match=r"one per batch row, shape \(5,\), not \(4,\)"):
        lstm_stack(torch.randn(3, 5, 12, dtype=F64), layers, 0.0, lengths=torch.ones(4))


def test_the_saved_factors_in_fp16_keep_gradients_within_fp16_error():
    """The kernels save the six factors in fp16: the same maths with fp16 buffers stays within
    about 1e-3 of float64."""
    steps, batch, k_in, hidden, n_layers, p = 6, 4, 32, 32, 2, 0.1
    layers = random_stack(k_in, hidden, n_layers)
    x = torch.randn(steps, batch, k_in, dtype=F64, requires_grad=True)
    seed, dy = seed_tensor(9), torch.randn(steps, batch, hidden, dtype=F64)
    want = torch.autograd.grad(stack_reference(x, layers, p, seed), [x, *flat(layers)], dy)
    half = [tuple(t.detach().half().requires_grad_(True) for t in w) for w in layers]
    x16 = x.detach().half().requires_grad_(True)
    got = torch.autograd.grad(lstm_stack(x16, half, p, seed), [x16, *flat(half)], dy.half())
    for g, w in zip(got, want):
        assert ((g.double() - w).norm() / w.norm()).item() < 4e-3


def test_the_gate_permutation_gives_a_thread_all_four_gates_of_one_unit():
    hidden = 1024
    perm = lstm_wave.gate_permutation(hidden)
    assert torch.equal(perm.sort().values, torch.arange(4 * hidden))
    for tile in (0, 5, 31):
        for warp in range(4):
            for r in range(8):
                # a thread's accumulator rows: 16 warp + r and + 8, in both 64-row halves
                rows = [
                    tile * 128 + 64 * half + 16 * warp + 8 * i + r
                    for half in (0, 1)
                    for i in (0, 1)
                ]
                gate, unit = perm[rows] // hidden, perm[rows] % hidden
                assert gate.tolist() == [0, 1, 2, 3]
                assert unit.unique().tolist() == [32 * tile + 8 * warp + r]
    with pytest.raises(ValueError, match="divisible by 32"):
        lstm_wave.gate_permutation(24)


# ----------------------------------------------------------------------------------------------
# the model switch


def test_config_values_the_wave_lstm_cannot_take_are_named():
    with pytest.raises(ConfigError, match="model.encoder_lstm: expected one of .* got 'cudnn9'"):
        tiny_cfg(encoder_lstm="cudnn9")
    with pytest.raises(ConfigError, match="model.enc_n_hid: .* multiple of 32 .* got 24"):
        tiny_cfg(encoder_lstm="wave", enc_n_hid=24)
    with pytest.raises(ConfigError, match=r"model.enc_dropout: .* 0 <= p < 1, got 1.0"):
        tiny_cfg(encoder_lstm="wave", enc_n_hid=32, enc_dropout=1.0)
    RNNT(tiny_cfg(encoder_lstm="cudnn", enc_n_hid=24))  # the cuDNN path takes any width


def test_the_wave_encoder_trains_the_same_function_on_the_same_parameters():
    kw = dict(enc_n_hid=32, in_feats=24, enc_dropout=0.0)
    torch.manual_seed(0)
    cudnn = RNNT(tiny_cfg(**kw)).double()
    wave = RNNT(tiny_cfg(encoder_lstm="wave", **kw)).double()
    assert list(wave.state_dict()) == list(cudnn.state_dict())
    wave.load_state_dict(cudnn.state_dict())
    x = torch.randn(11, 3, 24, dtype=F64)
    lens = torch.tensor([11, 9, 4])
    outs = []
    for model in (cudnn, wave):
        model.train()
        f, f_lens = model.encoder(x, lens)
        f.square().sum().backward()
        outs.append((f, f_lens, {n: p.grad for n, p in model.encoder.named_parameters()}))
    (f1, l1, g1), (f2, l2, g2) = outs
    assert torch.equal(l1, l2)
    assert (f1 - f2).abs().max() < 1e-12
    for name in g1:
        assert (g1[name] - g2[name]).abs().max() < 1e-10, name
    # evaluation runs nn.LSTM in both
    cudnn.eval(), wave.eval()
    with torch.no_grad():
        assert torch.equal(cudnn.encoder(x, lens)[0], wave.encoder(x, lens)[0])


def test_eval_encoder_lstm_wave_scores_with_the_kernels_forward(monkeypatch):
    calls = []
    real = lstm_wave.lstm_stack

    def counted(x, layers, p, *args, **kwargs):
        calls.append(p)
        return real(x, layers, p, *args, **kwargs)

    monkeypatch.setattr(lstm_wave, "lstm_stack", counted)
    kw = dict(enc_n_hid=32, in_feats=24, enc_dropout=0.3)
    torch.manual_seed(0)
    cudnn = RNNT(tiny_cfg(**kw)).double().eval()
    wave = RNNT(tiny_cfg(**kw), eval_encoder_lstm="wave").double().eval()
    wave.load_state_dict(cudnn.state_dict())
    x = torch.randn(11, 3, 24, dtype=F64)
    lens = torch.tensor([11, 9, 4])
    with torch.no_grad():
        f1, l1 = cudnn.encoder(x, lens)
        f2, l2 = wave.encoder(x, lens)
    assert calls == [0.0, 0.0]  # both stacks, dropout off
    assert torch.equal(l1, l2)
    assert (f1 - f2).abs().max() < 1e-12
    # training is untouched by the eval switch: nn.LSTM and nn.Dropout
    wave.train()
    wave.encoder(x, lens)
    assert calls == [0.0, 0.0]


def test_scoring_with_the_wave_forward_draws_nothing_from_torchs_generators():
    # The trainer scores between epochs; a draw there would shift every later dropout mask
    # and SpecAugment draw, so the same seed would train differently with eval.encoder_lstm
    # wave than with cudnn (it did, on an H200: a different dev WER curve from epoch 2).
    torch.manual_seed(0)
    wave = RNNT(tiny_cfg(enc_n_hid=32, in_feats=24), eval_encoder_lstm="wave").double().eval()
    x = torch.randn(11, 3, 24, dtype=F64)
    before = torch.get_rng_state()
    with torch.no_grad():
        wave.encoder(x, torch.tensor([11, 9, 4]))
    assert torch.equal(torch.get_rng_state(), before)
    # with dropout the seed is still drawn per call (fresh masks on every graph replay)
    lstm_wave.lstm_stack(x, wave.encoder.pre_rnn.layer_weights(), 0.3)
    assert not torch.equal(torch.get_rng_state(), before)


def test_eval_encoder_lstm_values_are_checked_against_the_model():
    from rnnt.config import load_config

    with pytest.raises(ConfigError, match="eval.encoder_lstm: expected one of .* got 'wav'"):
        load_config(None, ["eval.encoder_lstm=wav"])
    with pytest.raises(ConfigError, match="eval.encoder_lstm: wave needs .* multiple of 32"):
        load_config(None, ["eval.encoder_lstm=wave", "model.enc_n_hid=24"])


def test_eval_encoder_lstm_wave_is_refused_where_the_kernels_cannot_run(monkeypatch):

    monkeypatch.setattr(lstm_wave, "unsupported", lambda *args: "a Hopper GPU; this is 8.0")
    with pytest.raises(ConfigError, match="eval.encoder_lstm: wave cannot run here: a Hopper"):
        resolve_eval_encoder_lstm("wave", tiny_cfg(enc_n_hid=32), torch.device("cuda"))
    assert resolve_eval_encoder_lstm("cudnn", tiny_cfg(), torch.device("cuda"))[0] == "cudnn"


def test_the_wave_encoder_draws_fresh_dropout_per_call_from_torchs_generator():
    model = RNNT(tiny_cfg(enc_n_hid=32, encoder_lstm="wave", enc_dropout=0.3)).train()
    x, lens = torch.randn(6, 2, 16), torch.tensor([6, 6])
    with torch.no_grad():
        torch.manual_seed(3)
        first = model.encoder(x, lens)[0]
        second = model.encoder(x, lens)[0]
        torch.manual_seed(3)
        again = model.encoder(x, lens)[0]
    assert not torch.equal(first, second)
    assert torch.equal(first, again)


def test_auto_runs_cudnn_off_the_gpu(monkeypatch):
    def no_wave(*args, **kwargs):
        raise AssertionError("auto ran the wave kernels on the CPU")

    monkeypatch.setattr(lstm_wave, "lstm_stack", no_wave)
    x = torch.randn(3, 4, 8, 16)
    out = {}
    for lstm in ("cudnn", "auto"):
        torch.manual_seed(0)
        model = RNNT(tiny_cfg(encoder_lstm=lstm)).train()
        torch.manual_seed(1)
        out[lstm] = model.encoder.pre_rnn(x[0])[0]
    assert torch.equal(out["cudnn"], out["auto"])


def test_the_wave_stack_refuses_a_state():
    model = RNNT(tiny_cfg(enc_n_hid=32, encoder_lstm="wave")).train()
    state = (torch.zeros(2, 1, 32), torch.zeros(2, 1, 32))
    with pytest.raises(ValueError, match="zero state"):
        model.encoder.pre_rnn(torch.randn(3, 1, 16), state)


# ----------------------------------------------------------------------------------------------
# ragged batches against cuDNN's packed sequences


def real_frames(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    return torch.arange(steps)[:, None] < lengths[None, :]


def test_on_a_ragged_batch_the_stack_is_nn_lstm_on_packed_sequences():
    """cuDNN's packed sequences as the oracle of a ragged batch in no order: nn.LSTM runs each
    row over its own frames alone. The stack with the lengths gives its outputs at every real
    frame and its gradients (the output gradient zero past each row's length), dropout on."""
    steps, batch, k_in, hidden, n_layers, p = 7, 6, 128, 32, 2, 0.3
    layers = random_stack(k_in, hidden, n_layers, dtype=torch.float32)
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(steps, batch, k_in, generator=gen, requires_grad=True)
    lengths = torch.tensor([7, 3, 5, 1, 7, 4])
    real = real_frames(lengths, steps)
    dy = torch.randn(steps, batch, hidden, generator=gen) * real[..., None]
    seed = seed_tensor(21)
    y = lstm_stack(x, layers, p, seed, lengths=lengths)
    got = torch.autograd.grad(y, [x, *flat(layers)], dy)

    x_ref = x.detach().clone().requires_grad_(True)
    h, modules = x_ref, []
    for index, weights in enumerate(layers):
        lstm = nn.LSTM(weights[0].shape[1], hidden)
        with torch.no_grad():
            for name, value in zip(("weight_ih", "weight_hh", "bias_ih", "bias_hh"), weights):
                getattr(lstm, f"{name}_l0").copy_(value)
        packed = nn.utils.rnn.pack_padded_sequence(h, lengths, enforce_sorted=False)
        h, _ = nn.utils.rnn.pad_packed_sequence(lstm(packed)[0], total_length=steps)
        h = h * keep_mask(seed, index, steps, batch, hidden, p) / (1 - p)
        modules.append(lstm)
    h.backward(dy)
    torch.testing.assert_close(y[real], h[real], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], x_ref.grad, rtol=1e-5, atol=1e-6)
    for index, lstm in enumerate(modules):
        names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        for g, name in zip(got[1 + 4 * index : 5 + 4 * index], names):
            torch.testing.assert_close(g, getattr(lstm, f"{name}_l0").grad, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# the CUDA source (nvcc, no GPU needed) and the kernels (Hopper GPU)


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="needs nvcc")
def test_use_variants_sets_the_kernels_lstm_stack_runs_and_refuses_unknown_ones(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(cuda_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(lstm_wave, "_default_kernels", [])
    cuda_build.load.cache_clear()
    try:
        with pytest.raises(ValueError, match="no backward wave variant 3: the kernels have 0 to 2"):
            lstm_wave.use_variants(2, 3)
        with pytest.raises(ValueError, match="no forward wave variant -1"):
            lstm_wave.use_variants(-1, 2)
        assert lstm_wave._default_kernels == []
        lstm_wave.use_variants(0, 1)
        kernels = lstm_wave._cuda_kernels()
        assert (kernels.forward_variant, kernels.backward_variant) == (0, 1)
        assert lstm_wave._cuda_kernels() is kernels
    finally:
        cuda_build.load.cache_clear()


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="needs nvcc")
def test_the_kernel_source_builds_and_rejects_shapes_it_cannot_tile(tmp_path, monkeypatch):
    monkeypatch.setenv(cuda_build.CACHE_ENV, str(tmp_path))
    cuda_build.load.cache_clear()
    try:
        lib = lstm_wave.library()
        assert lib.wave_lstm_variants(0) == 3 and lib.wave_lstm_variants(1) == 3
        null = (ctypes.c_void_p * 3)()

        def forward(layers, steps, batch, kin, p=0.1, variant=0):
            kins = (ctypes.c_int * 3)(*kin)
            return lib.wave_lstm_forward(
                0, layers, steps, batch, kins, *[null] * 8, p, None, None, None, 0, variant, None
            )

        def backward(layers, steps, batch, kin, p=0.1):
            kins = (ctypes.c_int * 3)(*kin)
            return lib.wave_lstm_backward(
                0, layers, steps, batch, kins, *[null] * 5, None, p, None, None, None, 0, 0, None
            )

        # shapes it cannot tile are refused before anything touches a GPU
        for args in (
            (2, 10, 100, (256, 1024, 0)),
            (4, 10, 192, (256, 1024, 1024)),
            (2, 0, 192, (256, 1024, 0)),
            (2, 10, 192, (240, 1024, 0)),
            (2, 10, 192, (0, 1024, 0)),
        ):
            rc = forward(*args)
            assert "unsupported shape" in lib.wave_lstm_error(rc).decode()
        assert (
            "unsupported shape"
            in lib.wave_lstm_error(forward(2, 10, 192, (256, 1024, 0), p=1.0)).decode()
        )
        assert (
            "no such kernel variant"
            in lib.wave_lstm_error(forward(2, 10, 192, (256, 1024, 0), variant=4)).decode()
        )
        assert (
            "unsupported shape" in lib.wave_lstm_error(backward(2, 10, 96, (256, 1024, 0))).decode()
        )
        # the kernels' own dropout functions, run on the host, agree with keep_mask everywhere
        for seed, layer, p in ((1234, 0, 0.1), (2**31 - 2, 2, 0.3), (7, 1, 0.5)):
            mask = keep_mask(seed_tensor(seed), layer, 5, 12, 1024, p)
            kept = [
                [
                    [lib.wave_lstm_kept(seed, layer, t, b, u, p) for u in range(0, 1024, 7)]
                    for b in range(12)
                ]
                for t in range(5)
            ]
            assert torch.equal(torch.tensor(kept, dtype=torch.bool), mask[:, :, ::7])
    finally:
        cuda_build.load.cache_clear()


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_the_launch_schedule_keeps_every_dependency_and_fills_the_gpu_once(backward):
    def ctas(layer, n_layers, batch):
        if not backward:
            return 32 * batch // 96  # 128-row W tiles x 96-row batch tiles
        return 16 * batch // 96 * (1 if layer == n_layers - 1 else 2)  # partners below the top

    for n_layers, steps, batch, sms in (
        (3, 245, 192, 132),
        (2, 490, 192, 132),
        (3, 7, 192, 132),
        (1, 5, 192, 132),
        (3, 9, 384, 132),
        (3, 6, 192, 10_000),
        (2, 6, 192, 1),
        (3, 1, 192, 132),
    ):
        launches = lstm_wave.launch_schedule(backward, n_layers, steps, batch, sms)
        done = {}
        for index, cells in enumerate(launches):
            assert len({layer for layer, _ in cells}) == len(cells)  # a layer once per launch
            assert len(cells) == 1 or sum(ctas(l, n_layers, batch) for l, _ in cells) <= sms
            for layer, t in cells:
                assert (layer, t) not in done
                done[layer, t] = index
        assert sorted(done) == [(l, t) for l in range(n_layers) for t in range(steps)]
        # what each cell reads was written by an earlier launch: forward h(t - 1) and the layer
        # below; backward dz(t + 1) and the layer above
        step, deeper = (1, -1) if backward else (-1, 1)
        for (layer, t), index in done.items():
            for need in ((layer, t + step), (layer - deeper, t)):
                if need in done:
                    assert done[need] < index, ((layer, t), need)
        if (n_layers, steps, batch, sms) == (3, 245, 192, 132):
            # two 64-CTA cells per launch, not three in two rounds of 132 SMs
            assert len(launches) == 369
        if sms == 10_000 or (n_layers, steps) == (2, 490):
            assert len(launches) == steps + n_layers - 1  # whole waves, as before
        if sms == 1:
            assert len(launches) == n_layers * steps


def test_off_hopper_the_kernels_say_why():
    assert "CUDA device" in lstm_wave.unsupported(torch.device("cpu"), 1024, 2)


def cuda_buffers(steps, batch, k_in, n_layers, p, seed, layers, active=None):
    """Forward and backward buffers filled by the CUDA kernels and by TorchKernels from the same
    inputs (the backward from TorchKernels' factors). The outputs start as NaN, so that what a
    kernel leaves unwritten shows; a first layer wider than the hidden size runs as the autograd
    Function runs it, with x W_ih^T from one GEMM before the waves."""
    dev, hidden = "cuda", lstm_wave.HIDDEN
    perm = lstm_wave.gate_permutation(hidden, dev)
    w = [torch.cat(layer[:2], 1)[perm].half().contiguous() for layer in layers]
    bias = [(layer[2].float() + layer[3].float())[perm].contiguous() for layer in layers]
    x = (torch.randn(steps * batch, k_in, device=dev)).half()
    x_gates, w_run = None, w
    if k_in > hidden:
        x_gates = x @ w[0][:, :k_in].T
        w_run = [w[0][:, k_in:].contiguous(), *w[1:]]
    wt = [weight.t().contiguous() for weight in w]
    kin = [k_in] + [hidden] * (n_layers - 1)
    dy = (torch.randn(steps * batch, hidden, device=dev) * 0.1).half()
    rows = steps * batch

    def nans(*shape, dtype=torch.float16):
        return torch.full(shape, float("nan"), device=dev, dtype=dtype)

    out = {}
    for name, kernels in (("torch", lstm_wave.TorchKernels()), ("cuda", lstm_wave.CudaKernels())):
        hseq = [nans(rows + batch, hidden) for _ in layers]
        for h in hseq:
            h[:batch].zero_()
        yseq = [nans(rows, hidden) for _ in layers]
        cstate = [torch.zeros(batch, hidden, device=dev) for _ in layers]
        fac = [nans(6, rows, hidden) for _ in layers]
        kernels.forward(x, hseq, yseq, cstate, fac, bias, w_run, p, seed, x_gates, active)
        # both backwards from the same factors
        factors = fac if name == "torch" else out["torch"]["fac"]
        dz = [nans(rows, 4 * hidden) for _ in layers]
        dc = [torch.zeros(batch, hidden, device=dev) for _ in layers]
        dbias = [nans(rows // 96, 4 * hidden, dtype=torch.float32) for _ in layers]
        kernels.backward(kin, wt, dz, factors, dc, dbias, dy, p, seed, active)
        out[name] = dict(h=hseq, y=yseq, c=cstate, fac=fac, dz=dz, dbias=dbias)
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "k_in,n_layers,longest",
    [(256, 2, None), (2048, 3, None), (256, 2, 4), (2048, 3, 1)],
    ids=["pre", "post-hoisted", "pre-padding", "post-padding"],
)
def test_gpu_buffers_match_the_torch_kernels(k_in, n_layers, longest):
    steps, batch, p = 6, 192, 0.1
    layers = random_stack(
        k_in, lstm_wave.HIDDEN, n_layers, dtype=torch.float32, device="cuda", scale=0.03, grad=False
    )
    seed = seed_tensor(77, "cuda")
    active = None if longest is None else torch.tensor([longest], dtype=torch.int32, device="cuda")
    out = cuda_buffers(steps, batch, k_in, n_layers, p, seed, layers, active)
    n = steps if longest is None else longest
    for name in ("h", "y", "c", "fac", "dz", "dbias"):
        for got, want in zip(out["cuda"][name], out["torch"][name]):
            if name == "fac":  # not written at the padding steps
                got, want = got[:, : n * batch], want[:, : n * batch]
            assert not got.isnan().any(), name
            err = (got.float() - want.float()).abs().max().item()
            scale = want.float().abs().max().item()
            assert err < 4e-3 * max(1.0, scale), (name, err, scale)
    for layer in range(n_layers):
        h = out["cuda"]["h"][layer][batch:].view(steps, batch, -1)
        y = out["cuda"]["y"][layer].view(steps, batch, -1)
        assert torch.equal(h[n:], torch.zeros_like(h[n:]))
        assert torch.equal(y[n:], torch.zeros_like(y[n:]))
        dz = out["cuda"]["dz"][layer].view(steps, batch, -1)
        assert torch.equal(dz[n:], torch.zeros_like(dz[n:]))
        # dropout: exactly the hash masks (dropped where h is not zero)
        mask = keep_mask(seed, layer, steps, batch, lstm_wave.HIDDEN, p)
        assert torch.equal((y == 0) & (h != 0), ~mask & (h != 0))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "k_in,n_layers,batch,longest",
    [(256, 2, 192, 12), (2048, 3, 192, 12), (240, 2, 100, 12), (2048, 3, 192, 7)],
    ids=["pre", "post", "padded", "padding-steps"],
)
def test_gpu_wave_stack_gradients_are_as_close_to_fp32_as_cudnn_fp16(
    k_in, n_layers, batch, longest
):
    """Against the fp32 reference over the longest length (the steps after it are padding)."""
    steps, p = 12, 0.1
    layers = random_stack(
        k_in, lstm_wave.HIDDEN, n_layers, dtype=torch.float32, device="cuda", scale=0.03
    )
    x = torch.randn(steps, batch, k_in, device="cuda", requires_grad=True)
    dy = torch.randn(steps, batch, lstm_wave.HIDDEN, device="cuda") * 0.01
    seed = seed_tensor(5, "cuda")
    params = [x, *flat(layers)]
    n = longest
    want = torch.autograd.grad(stack_reference(x[:n], layers, p, seed), params, dy[:n])
    lengths = torch.full((batch,), n, device="cuda") if n < steps else None
    y = lstm_stack(x, layers, p, seed, lengths=lengths)
    got = torch.autograd.grad(y, params, dy)
    assert torch.equal(y[n:], torch.zeros_like(y[n:]))
    # the yardstick: the same stack in fp16 (cuDNN-like rounding), against fp32
    half = [tuple(t.detach().half().requires_grad_(True) for t in w) for w in layers]
    x16 = x.detach().half().requires_grad_(True)
    yard = torch.autograd.grad(
        stack_reference(x16[:n], half, p, seed), [x16, *flat(half)], dy[:n].half()
    )
    for g, w, h16 in zip(got, want, yard):
        err = ((g.float() - w).norm() / w.norm()).item()
        err16 = ((h16.float() - w).norm() / w.norm()).item()
        assert err < max(3 * err16, 2e-3), (err, err16)


@pytest.mark.gpu
@needs_hopper
def test_gpu_auto_runs_the_wave_kernels_for_multiples_of_192_rows(monkeypatch):
    calls = []
    real = lstm_wave.lstm_stack

    def counted(x, *args, **kwargs):
        calls.append(x.shape[1])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(lstm_wave, "lstm_stack", counted)
    cfg = tiny_cfg(encoder_lstm="auto", enc_n_hid=lstm_wave.HIDDEN, in_feats=256)
    model = RNNT(cfg).cuda().half().train()
    for batch in (192, 64):
        model.encoder.pre_rnn(torch.randn(4, batch, 256, device="cuda", dtype=torch.float16))
    assert calls == [192]


@pytest.mark.gpu
@needs_hopper
def test_gpu_eval_encoder_lstm_wave_scores_like_cudnn_on_a_ragged_dev_batch():
    cfg = tiny_cfg(enc_n_hid=lstm_wave.HIDDEN, in_feats=256)
    torch.manual_seed(0)
    cudnn = RNNT(cfg).cuda().half().eval()
    wave = RNNT(cfg, eval_encoder_lstm="wave").cuda().half().eval()
    wave.load_state_dict(cudnn.state_dict())
    exact = RNNT(cfg).cuda().float().eval()
    exact.load_state_dict(cudnn.state_dict())
    steps, batch = 60, 338  # the dev set's batch: no multiple of the kernels' rows
    lens = torch.randint(1, steps + 1, (batch,), device="cuda")
    lens[0] = steps
    x = torch.randn(steps, batch, 256, device="cuda") * 0.5
    with torch.no_grad():
        want, want_lens = exact.encoder(x, lens)
        f16, _ = cudnn.encoder(x.half(), lens)
        got, got_lens = wave.encoder(x.half(), lens)
    assert torch.equal(got_lens, want_lens) and got.dtype == torch.float16
    valid = torch.arange(want.shape[1], device="cuda")[None, :] < want_lens[:, None]
    err = (got.float() - want)[valid].norm() / want[valid].norm()
    err16 = (f16.float() - want)[valid].norm() / want[valid].norm()
    assert err < max(3 * err16, 2e-3), (err.item(), err16.item())


@pytest.mark.gpu
@needs_hopper
def test_gpu_every_variant_is_bitwise_the_same_and_graphs_draw_fresh_masks():
    steps, batch, k_in, p = 5, 192, 256, 0.1
    layers = random_stack(k_in, lstm_wave.HIDDEN, 2, dtype=torch.float16, device="cuda", scale=0.03)
    x = torch.randn(steps, batch, k_in, device="cuda", dtype=torch.float16, requires_grad=True)
    seed = seed_tensor(11, "cuda")
    results = []
    lib = lstm_wave.library()
    for fv in range(lib.wave_lstm_variants(0)):
        for bv in range(lib.wave_lstm_variants(1)):
            kernels = lstm_wave.CudaKernels(fv, bv)
            y = lstm_stack(x, layers, p, seed, kernels)
            results.append((y, *torch.autograd.grad(y.float().sum(), [x, *flat(layers)])))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    # no host sync in forward or backward; a captured step draws a new seed per replay
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (the library, cuBLAS handles) outside capture
            lstm_stack(x, layers, p).sum().backward()
        torch.cuda.set_sync_debug_mode("error")
        try:
            lstm_stack(x, layers, p).float().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = lstm_stack(x.detach(), layers, p)
    stream.synchronize()
    masks = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        masks.append(out == 0)
    assert not torch.equal(masks[0], masks[1])


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("k_in, n_layers, batch", [(256, 2, 192), (2048, 3, 384)])
def test_gpu_overlapped_waves_give_the_bits_of_serialized_ones_on_long_ragged_stacks(
    k_in, n_layers, batch
):
    """The default variant (each wave starts before the previous one ends) against variant 0
    (each wave after the previous one), over enough steps and repeats that a wave reading what
    its predecessor has not yet written would show: the pre-RNN shape, and the post-RNN one with
    its hoisted input GEMM, four batch tiles and padding steps."""
    steps, p = 150, 0.1
    layers = random_stack(
        k_in, lstm_wave.HIDDEN, n_layers, dtype=torch.float16, device="cuda", scale=0.03
    )
    x = torch.randn(steps, batch, k_in, device="cuda", dtype=torch.float16, requires_grad=True)
    dy = torch.randn(steps, batch, lstm_wave.HIDDEN, device="cuda", dtype=torch.float16)
    lengths = torch.randint(1, steps - 20, (batch,), device="cuda")
    seed = seed_tensor(3, "cuda")
    params = [x, *flat(layers)]

    def run(kernels):
        y = lstm_stack(x, layers, p, seed, kernels, lengths=lengths)
        return (y, *torch.autograd.grad(y, params, dy))

    want = run(lstm_wave.CudaKernels(0, 0))
    assert want[0].abs().sum() > 0 and all(g.abs().sum() > 0 for g in want[1:])
    for _ in range(3):
        got = run(lstm_wave.CudaKernels())
        assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "steps, k_in, n_layers, batch", [(37, 256, 2, 192), (36, 2048, 3, 384)], ids=["pre", "post"]
)
def test_gpu_stack_pairs_are_stack_time_of_the_stack_bit_for_bit(steps, k_in, n_layers, batch):
    """The kernels' frame-pair output with each row's padding zeroed, against StackTime(2) of
    their plain output: the same bits forward and backward, for odd and even T, ragged rows
    (odd lengths leave half a pair), and bucket padding steps."""
    p = 0.1
    layers = random_stack(
        k_in, lstm_wave.HIDDEN, n_layers, dtype=torch.float16, device="cuda", scale=0.03
    )
    x = torch.randn(steps, batch, k_in, device="cuda", dtype=torch.float16, requires_grad=True)
    lengths = torch.randint(1, steps - 4, (batch,), device="cuda")
    lengths[0] = steps - 5
    seed = seed_tensor(17, "cuda")
    params = [x, *flat(layers)]
    stacked = lstm_stack(x, layers, p, seed, lengths=lengths, stack_pairs=True)
    want, _ = StackTime(2)(lstm_stack(x, layers, p, seed, lengths=lengths), lengths)
    assert stacked.shape == want.shape and torch.equal(stacked, want)
    dy = torch.randn(want.shape, device="cuda", dtype=torch.float16)
    got = torch.autograd.grad(stacked, params, dy)
    expected = torch.autograd.grad(want, params, dy)
    assert all(torch.equal(g, w) for g, w in zip(got, expected))
    assert got[0].abs().sum() > 0


@pytest.mark.gpu
@needs_hopper
def test_gpu_scoring_writes_no_factor_planes_and_gives_the_same_bits():
    steps, batch, k_in = 64, 192, 2048
    layers = random_stack(k_in, lstm_wave.HIDDEN, 3, dtype=torch.float16, device="cuda", scale=0.03)
    x = torch.randn(steps, batch, k_in, device="cuda", dtype=torch.float16)
    lengths = torch.randint(1, steps + 1, (batch,), device="cuda")
    trained = lstm_stack(x, layers, 0.0, lengths=lengths).detach()
    peaks = []
    for grad in (True, False):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.set_grad_enabled(grad):
            y = lstm_stack(x, layers, 0.0, lengths=lengths)
        peaks.append(torch.cuda.max_memory_allocated() - base)
        assert torch.equal(y.detach(), trained)
        del y
    planes = 3 * lstm_wave.N_FACTORS * steps * batch * lstm_wave.HIDDEN * 2  # fp16 bytes
    assert peaks[0] - peaks[1] >= planes
