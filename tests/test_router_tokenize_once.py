"""The router tokenizes a prompt once: the ids that set its length are the ids the prefix cache
looks up (router/http/validation.py prompt_ids, kept by router/http/state.py)."""

import asyncio
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from router.http.state import RouterState, submit
from router.http.validation import Parameters


class CountingTokenizer:
    """The real tokenizer, counting the prompts it tokenizes."""

    def __init__(self, inner):
        self.inner, self.prompts = inner, []

    def __call__(self, text, **kwargs):
        self.prompts.append(text)
        return self.inner(text, **kwargs)

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class QueueingScheduler:
    """Records what submit queues."""

    def __init__(self):
        self.queued = []

    def check_admission(self, count=1):
        pass

    def submit(self, request, input_length, token_ids=None):
        self.queued.append((request, input_length, token_ids))
        return SimpleNamespace()


@pytest.mark.parametrize("prefix_caching, truncate", [(True, None), (True, 3), (False, None)])
def test_a_prompt_is_tokenized_once(smollm_dir, prefix_caching, truncate):
    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(smollm_dir))
    scheduler = QueueingScheduler()
    info = {"max_input_tokens": 64, "max_total_tokens": 128, "prefix_caching": prefix_caching}
    state = RouterState(
        scheduler,
        tokenizer,
        None,
        info,
        SimpleNamespace(timed=lambda s, a: s),
        grammar_check=lambda text, kind, reasoning: None,
    )
    prompt = "The quick brown fox jumps over the lazy dog."
    asyncio.run(submit(state, prompt, Parameters(max_new_tokens=4, truncate=truncate)))
    state.executor.shutdown()
    assert tokenizer.prompts == [prompt]
    expected = tokenizer.inner(prompt)["input_ids"][-(truncate or 0) :]
    request, length, token_ids = scheduler.queued[0]
    assert length == len(expected)
    assert token_ids == (expected if prefix_caching else None)
