"""Speculative decoding: proposers guess a sequence's next tokens, one verify forward of the target
checks them all, and acceptance keeps exactly the tokens plain decoding would have chosen.

ngram.py    prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
            newest n-gram (CPU-side, no weights)
draft.py    a draft model proposer: a smaller model with the target's tokenizer, its own paged KV
            cache (the target's block ids) and warmed buckets
eagle3.py   EAGLE-3 heads: a one-layer draft over the target's hidden states from three of its
            layers, its own KV cache and warmed buckets
eagle3_checkpoint.py  an EAGLE-3 checkpoint in vLLM's layout: config.json checked against the
            target, the weights read into the head
buckets.py  the verify buckets `(batch, K + 1, context blocks)`, planned and warmed with the others
step.py     a decode step that proposes, verifies in one forward and accepts token by token
            (the rejection rule for a draft's sampled proposals), and adaptive K
"""
