"""The offline path (router/offline.py) runs the shard's calls on the thread that built and warmed
it, while the scheduler's event loop runs on a thread of its own: a second thread running torch
would keep a second OpenMP pool, and with more OpenMP threads than cores the steps' pools sleep
between parallel regions (on the 2-core VM `bucketserve bench` decoded at 82-84 tok/s instead of
153-179)."""

import threading

import pytest

from router.offline import CallerThread, run_scheduled
from tests.helpers import build_request, tiny_shard


def test_the_shard_steps_on_the_thread_that_built_it(tiny_model_dirs):
    shard = tiny_shard(tiny_model_dirs["llama"], max_batch_size=2)
    threads = {"prefill": set(), "decode": set()}
    for name in threads:
        step = getattr(shard, name)

        def recorded(*args, _step=step, _name=name, **kwargs):
            threads[_name].add(threading.get_ident())
            return _step(*args, **kwargs)

        setattr(shard, name, recorded)
    prompt = "The quick brown fox jumps over the lazy dog."
    length = len(shard.tokenizer(prompt)["input_ids"])
    requests = [build_request(i, 6, prompt) for i in range(2)]
    outputs = run_scheduled(shard, requests, [length] * 2, shard.runner.kv_cache.capacity_tokens)
    assert threads == {"prefill": {threading.get_ident()}, "decode": {threading.get_ident()}}
    generated = [[t for g in outputs[r.id] for t in g.tokens.ids] for r in requests]
    assert len(generated[0]) == 6 and generated[0] == generated[1]


def test_the_caller_thread_runs_calls_in_order_and_hands_back_errors():
    calls = CallerThread()
    order, futures = [], []

    def submit_from_another_thread():
        futures.append(calls.submit(order.append, 1))
        futures.append(calls.submit(lambda: 1 / 0))
        futures.append(calls.submit(order.append, 2))
        calls.stop()

    other = threading.Thread(target=submit_from_another_thread)
    other.start()
    calls.serve()  # returns at stop(), after every call before it
    other.join()
    assert order == [1, 2]
    with pytest.raises(ZeroDivisionError):
        futures[1].result()
