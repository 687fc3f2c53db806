import pytest

from rnnt.config import OptimizerConfig, load_config
from rnnt.optim.schedule import lr_at

# warmup 2 epochs, hold 3 epochs, 10 steps per epoch: W = 20, H = 30
CFG = OptimizerConfig(lr=0.01, min_lr=1e-5, warmup_epochs=2, hold_epochs=3, lr_decay_gamma=0.5)
SPE = 10


def at(step):
    """The 1-based epoch that holds 1-based `step`."""
    return (step - 1) // SPE + 1


@pytest.mark.parametrize(
    "step,expected",
    [
        (1, 0.01 * 2 / 21),  # first step of the run
        (10, 0.01 * 11 / 21),
        (19, 0.01 * 20 / 21),  # last warmup step
        (20, 0.01),  # last step of epoch 2: hold begins
        (21, 0.01),
        (49, 0.01),  # last hold step
        (50, 0.01),  # last step of epoch 5: decay at gamma ** 0
        (51, 0.005),  # epoch 6: gamma ** 1
        (60, 0.005),
        (61, 0.0025),  # epoch 7: gamma ** 2
    ],
)
def test_boundaries(step, expected):
    assert lr_at(step, at(step), SPE, CFG) == pytest.approx(expected, rel=1e-12)


def test_floor_at_min_lr():
    # gamma ** 20 * 0.01 ~ 9.5e-9 < 1e-5
    assert lr_at(251, at(251), SPE, CFG) == 1e-5
    assert lr_at(10_000, at(10_000), SPE, CFG) == 1e-5


def test_monotone_warmup_then_non_increasing():
    lrs = [lr_at(s, at(s), SPE, CFG) for s in range(1, 200)]
    assert all(a < b for a, b in zip(lrs[:19], lrs[1:20]))
    assert all(a >= b for a, b in zip(lrs[19:], lrs[20:]))


def test_gbs1024_preset_first_decayed_epoch(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  preset: gbs1024\n")
    cfg = load_config(path).optimizer  # warmup 3, hold 17, gamma 0.9037, lr 0.007447
    spe = 271
    first_decayed_step = 20 * spe + 1
    assert lr_at(first_decayed_step - 1, 20, spe, cfg) == cfg.lr
    assert lr_at(first_decayed_step, 21, spe, cfg) == pytest.approx(0.007447 * 0.9037)


@pytest.mark.parametrize("step,epoch,spe", [(0, 1, 10), (1, 0, 10), (1, 1, 0)])
def test_rejects_zero_based_or_empty(step, epoch, spe):
    with pytest.raises(ValueError, match="lr_at"):
        lr_at(step, epoch, spe, CFG)
