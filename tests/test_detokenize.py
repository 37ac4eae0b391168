from engine.serving.detokenize import REPLACEMENT_CHAR, decode_next


def test_incremental_text_never_splits_a_character(smollm_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    text = "Grüße 🙂 from 東京, naïve café 🎉!"
    prompt = tokenizer("Say:")["input_ids"]
    generated = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(generated) > len(text.split())  # the emoji and CJK characters span several tokens
    ids, prefix, read, pieces = list(prompt), max(len(prompt) - 5, 0), len(prompt), []
    for token in generated:
        ids.append(token)
        piece, prefix, read = decode_next(tokenizer, ids, prefix, read)
        assert REPLACEMENT_CHAR not in piece
        pieces.append(piece)
    assert "".join(pieces) == text
    assert pieces.count("") > 0  # some tokens had to wait for the rest of their character
