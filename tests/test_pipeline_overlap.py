"""Pipelining is real: steps of a pipeline shard take turns in the router's order
(engine/pipeline/turns.py), the stages' spans measure what overlapped (engine/pipeline/measure.py),
and two stages on two processes (gloo, CPU) with two batches in flight overlap: stage 0 works on
one batch while the last stage works on the other, and the greedy tokens stay transformers'."""

import threading
import time

import pytest

from engine.pipeline.measure import cross_step_overlaps, together_ns, utilization
from engine.pipeline.stage import Span
from engine.pipeline.turns import StepTurns
from scripts.bench_pipeline import decode_orders, run_pipeline
from tests.helpers import PROMPTS, reference_tokens
from tests.models import build_tiny_model

# --- turns -----------------------------------------------------------------------------------


def run_steps(turns: StepTurns, orders: list[int], give_away: set[int], log: list) -> None:
    """Each step on its own thread, started in the list's order (not the steps' order)."""

    def step(order: int) -> None:
        with turns.turn(order):
            log.append(("start", order))
            if order in give_away:
                with turns.given_away():
                    time.sleep(0.05)  # waits for another stage: the next step starts meanwhile
            log.append(("end", order))

    threads = [threading.Thread(target=step, args=(order,)) for order in orders]
    for thread in threads:
        thread.start()
        time.sleep(0.01)
    for thread in threads:
        thread.join()


def test_steps_start_in_the_routers_order_whatever_order_they_arrive_in():
    log = []
    run_steps(StepTurns(), [3, 1, 2], set(), log)
    assert log == [("start", 1), ("end", 1), ("start", 2), ("end", 2), ("start", 3), ("end", 3)]


def test_a_step_that_gives_its_turn_away_lets_the_next_one_start():
    log = []
    run_steps(StepTurns(), [1, 2], {1}, log)
    assert log == [("start", 1), ("start", 2), ("end", 2), ("end", 1)]


def test_calls_without_an_order_take_a_free_turn_and_a_missing_step_is_waited_for_a_while():
    turns, log = StepTurns(missing_step_wait_s=0.2), []
    run_steps(turns, [2, 0], set(), log)  # step 1 never comes
    assert log == [("start", 0), ("end", 0), ("start", 2), ("end", 2)]
    turns.reset()
    log.clear()
    run_steps(turns, [1], set(), log)  # after Warmup the numbering starts over
    assert log == [("start", 1), ("end", 1)]


# --- measuring spans -----------------------------------------------------------------------


def test_spans_give_utilization_time_together_and_overlaps_across_steps():
    first = [Span(0, 10, 1), Span(10, 20, 2)]
    last = [Span(12, 22, 1), Span(30, 40, 2)]
    assert utilization(first, 0, 40) == 0.5 and utilization(last, 0, 40) == 0.5
    assert together_ns(first, last, 0, 40) == 8
    assert cross_step_overlaps(first, last) == [(2, 1)]  # stage 0 on step 2, the last on 1
    assert cross_step_overlaps(first[:1], last) == []


def test_the_lanes_number_their_decodes_in_turn():
    assert decode_orders(0, 3) == [3, 5, 7] and decode_orders(1, 3) == [4, 6, 8]


# --- two stages on two processes --------------------------------------------------------------

STEPS, ROWS = 6, 2


@pytest.fixture(scope="module")
def four_layer_model(tmp_path_factory, smollm_dir):
    root = tmp_path_factory.mktemp("pipelined")
    return build_tiny_model("llama", root / "llama", smollm_dir, num_hidden_layers=4)


@pytest.mark.slow
def test_with_two_batches_in_flight_the_stages_overlap_and_tokens_stay_transformers(
    four_layer_model,
):
    texts = PROMPTS[: 2 * ROWS]
    run = run_pipeline(four_layer_model, lanes=2, steps=STEPS, rows=ROWS, texts=texts)
    first, last = run["spans"]
    # Stage 0 ran one batch's layers while the last stage ran the other batch's.
    overlaps = cross_step_overlaps(first, last)
    assert overlaps, (first, last)
    lanes_of = {(a % 2, b % 2) for a, b in overlaps}
    assert lanes_of <= {(0, 1), (1, 0)}  # the steps that overlapped are of different lanes
    assert run["tokens"] == reference_tokens(four_layer_model, texts, STEPS + 1)
