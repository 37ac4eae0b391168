"""A model directory whose only tokenizer is a sentencepiece `tokenizer.model` (older Llama 2 and
Mistral checkpoints): its tokenizer loads, and a tiny Llama with it generates transformers'
tokens."""

import json
from pathlib import Path

import pytest
import sentencepiece
import tomllib

from engine.serving.shard import Shard
from launcher.generate import generate
from tests.conftest import tiny_config
from tests.models import build_tiny_model
from tests.test_equivalence import PROMPTS, reference_tokens

VOCAB = 256
NEW_TOKENS = 20
# What Llama 2's checkpoints ship beside their tokenizer.model: the class, and bos before each
# prompt.
LLAMA2_TOKENIZER_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "legacy": False,
}


def train_tokenizer(out: Path) -> Path:
    """A tiny sentencepiece model with Llama's special ids (unk 0, bos 1, eos 2), trained on the
    test prompts: a `tokenizer.model` file as the old checkpoints ship it."""
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(PROMPTS * 4) + "\n")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(out / "tokenizer"),
        vocab_size=VOCAB,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    corpus.unlink()
    (out / "tokenizer.vocab").unlink()
    return out / "tokenizer.model"


@pytest.fixture(scope="module")
def sentencepiece_model_dirs(tmp_path_factory):
    """alone: config.json, weights and tokenizer.model; llama2: with Llama 2's
    tokenizer_config.json too."""
    root = tmp_path_factory.mktemp("sentencepiece")
    no_tokenizer = root / "none"
    no_tokenizer.mkdir()
    dirs = {}
    for name in ("alone", "llama2"):
        dirs[name] = build_tiny_model("llama", root / name, no_tokenizer, vocab_size=VOCAB)
        train_tokenizer(dirs[name])
    (dirs["llama2"] / "tokenizer_config.json").write_text(json.dumps(LLAMA2_TOKENIZER_CONFIG))
    return dirs


def test_the_package_declares_sentencepiece():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert any(
        dep.split(">")[0].split("=")[0].strip() == "sentencepiece"
        for dep in pyproject["project"]["dependencies"]
    )


@pytest.mark.parametrize("name", ["alone", "llama2"])
def test_a_sentencepiece_tokenizer_model_serves(sentencepiece_model_dirs, name):
    model_dir = sentencepiece_model_dirs[name]
    assert not (model_dir / "tokenizer.json").exists() and (model_dir / "tokenizer.model").is_file()
    shard = Shard(tiny_config(model_dir), show_progress=False)
    ids = shard.tokenizer("Hi there")["input_ids"]
    assert shard.tokenizer.convert_ids_to_tokens(ids)[-2:] == [
        "▁Hi",
        "▁there",
    ]  # sentencepiece's pieces
    assert (ids[0] == 1) == (name == "llama2")  # bos where the tokenizer config asks for it
    ours = generate(shard, PROMPTS, NEW_TOKENS, ignore_eos=True)
    assert [c.token_ids for c in ours] == reference_tokens(model_dir, PROMPTS, NEW_TOKENS)
    assert ours[1].text == shard.tokenizer.decode(ours[1].token_ids, skip_special_tokens=True)
