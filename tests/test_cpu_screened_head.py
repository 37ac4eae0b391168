"""A draft's LM head screened in int4 (engine/devices/cpu/kernels/screened_head.cpp): every logit
from the int4 screen, each row's 16 best rescored from the int8 codes; and greedy_steps' argmax
(decoder.cpp's first_argmax) against torch.argmax."""

import pytest
import torch

from engine.devices.cpu import kernels as cpu_kernels
from engine.layers.quant import int4_codes, int8_per_channel
from tests.isa_levels import skip_module_below
from tests.test_cpu_quant_kernels import bfloat16_step

skip_module_below("avx512_bf16")  # their only level so far


@pytest.fixture(autouse=True)
def at_avx512_bf16(kernels_at):
    kernels_at("avx512_bf16")


KEEP = 16  # screened_head.cpp's SCREEN_KEEP


def head(vocab: int, width: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return int8_per_channel(torch.randn(vocab, width, generator=generator) * 0.05, torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 3, 40])  # a draft step, a catch-up, a prefill's widened path
@pytest.mark.parametrize("vocab, width", [(1000, 576), (77, 64)])  # a partial last block
def test_a_rows_best_logits_are_the_int8_heads_and_the_rest_the_screens(rows, vocab, width):
    weight = head(vocab, width, seed=rows)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = cpu_kernels.ScreenedHead.of(weight).linear(x)
    assert out.shape == (rows, vocab) and out.dtype == torch.bfloat16

    codes, scale, zero = int4_codes(weight.dequantize(), torch.bfloat16)
    screen_weight = cpu_kernels.load().pack_int4(
        codes.to(torch.uint8), scale.bfloat16(), zero.bfloat16()
    )
    screen = cpu_kernels.load().int4_linear(x, screen_weight, vocab)
    # the 16 best by the screen; a tie at the 16th place may go either way
    kth = screen.float().topk(KEEP, dim=1).values[:, -1:]
    above, below = screen.float() > kth, screen.float() < kth
    assert torch.equal(out[below], screen[below])

    exact = (x.double() @ weight.codes.double().t()) * weight.scale.double()
    close = (out.double() - exact).abs() <= bfloat16_step(exact)
    assert close[above].all()
    tied = ~above & ~below
    assert (close[tied] | (out[tied] == screen[tied])).all()
    # and the screen's own values were not that close: the rescoring is what put them there
    assert not ((screen.double() - exact).abs() <= bfloat16_step(exact))[above].all()


def test_the_screened_argmax_is_the_int8_heads_on_a_vocabulary_of_the_embedded_models_size():
    weight = head(49152, 576, seed=0)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    screened = cpu_kernels.ScreenedHead.of(weight).linear(x).float()
    int8 = cpu_kernels.Int8Linear.of(weight).linear(x).float()
    assert torch.equal(screened.argmax(1), int8.argmax(1))


def test_the_screened_head_refuses_a_packed_head_of_another_size():
    screened = cpu_kernels.ScreenedHead.of(head(100, 64, seed=0))
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="a head packed by pack_screened for 99 tokens"):
        cpu_kernels.load().screened_linear(x, screened.packed, 99)
    with pytest.raises(RuntimeError, match="a multiple of 32 inputs"):
        cpu_kernels.load().screened_linear(torch.randn(1, 48).bfloat16(), screened.packed, 100)


def logits_cases():
    generator = torch.Generator().manual_seed(0)
    for n in (1, 15, 16, 17, 49152, 49153):
        # few distinct values: ties for the maximum, inside and across vectors
        yield torch.randint(0, 5, (n,), generator=generator).bfloat16()
    for n, nans in ((32, [5]), (40, [33]), (40, [35, 3]), (49152, [49151]), (20, [17, 19])):
        values = torch.randn(n, generator=generator).bfloat16()
        values[nans] = float("nan")
        yield values
    yield torch.full((33,), float("-inf"), dtype=torch.bfloat16)
    negative = -torch.rand(48, generator=generator).bfloat16() - 1
    negative[47] = -0.5  # the maximum in the last vector
    yield negative


@pytest.mark.parametrize("case", range(len(list(logits_cases()))))
def test_greedy_steps_argmax_is_torch_argmax(case):
    logits = list(logits_cases())[case]
    assert cpu_kernels.load().first_argmax(logits) == torch.argmax(logits).item()


def test_the_screened_head_reads_back_the_int8_weight_it_screens():
    weight = head(100, 64, seed=0)
    assert torch.equal(cpu_kernels.ScreenedHead.of(weight).dequantize(), weight.dequantize())
