"""A tiny random LLaVA (CLIP tower, Llama language model) saved as a Hugging Face directory with
its tokenizer (the embedded model's, plus an `<image>` token) and its own image processor."""

from __future__ import annotations

import io
from pathlib import Path

import torch

IMAGE_SIZE, PATCH = 28, 7  # 16 image tokens per image


def build_tiny_llava(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE_SIZE,
            patch_size=PATCH,
            projection_dim=32,
            initializer_range=0.2,
        ),
        text_config=transformers.LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            initializer_range=0.2,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        ),
        image_token_index=image_token,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor.save_pretrained(out_dir)
    return out_dir


def image_bytes(width: int, height: int, seed: int = 0, kind: str = "PNG") -> bytes:
    """A random RGB image, encoded."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, format=kind)
    return out.getvalue()


def llava_reference(model_dir, chunks: list, new_tokens: int, add_special_tokens=True, eos=False):
    """transformers' own LLaVA, tokenizer and image processor, greedy on one prompt given as text
    pieces and image bytes (or ImageInput) in order; eos: stop at EOS (else exactly new_tokens)."""
    import transformers
    from PIL import Image

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    side = model.config.vision_config.image_size // model.config.vision_config.patch_size
    text = "".join(c if isinstance(c, str) else "<image>" * side**2 for c in chunks)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens)["input_ids"]
    images = [
        Image.open(io.BytesIO(getattr(c, "data", c))).convert("RGB")
        for c in chunks
        if not isinstance(c, str)
    ]
    extra = {}
    if images:
        extra["pixel_values"] = processor(images=images, return_tensors="pt")["pixel_values"]
    least = {} if eos else {"min_new_tokens": new_tokens}
    out = model.generate(ids, **extra, max_new_tokens=new_tokens, do_sample=False, **least)
    return out[0, ids.shape[1] :].tolist()


NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56]]  # a grid of 1x2, 2x1 or 2x2 tiles of 28 pixels


def build_tiny_llava_next(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny random LLaVA-NeXT: the tiny LLaVA's tower and language model, images tiled."""
    import transformers

    build_tiny_llava(out_dir, tokenizer_dir, seed)  # its tokenizer and parts' configs
    llava = transformers.LlavaConfig.from_pretrained(out_dir)
    config = transformers.LlavaNextConfig(
        vision_config=llava.vision_config,
        text_config=llava.text_config,
        image_token_index=llava.image_token_id,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=NEXT_PINPOINTS,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlavaNextForConditionalGeneration(config).eval()
    for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
        (out_dir / name).unlink(missing_ok=True)
    model.save_pretrained(out_dir)
    processor = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_grid_pinpoints=NEXT_PINPOINTS,
    )
    processor.save_pretrained(out_dir)
    return out_dir


def llava_next_reference(model_dir, chunks: list, new_tokens: int, **tokenize) -> list[int]:
    """transformers' own LLaVA-NeXT and processor (which counts each image's tokens itself),
    greedy on one prompt of text pieces and image bytes in order, exactly new_tokens
    (`tokenize`: the tokenizer's options, such as add_special_tokens)."""
    import transformers
    from PIL import Image

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    processor = transformers.LlavaNextProcessor(
        image_processor=transformers.AutoImageProcessor.from_pretrained(model_dir),
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    model = transformers.LlavaNextForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    text = "".join(c if isinstance(c, str) else "<image>" for c in chunks)
    images = [
        Image.open(io.BytesIO(getattr(c, "data", c))).convert("RGB")
        for c in chunks
        if not isinstance(c, str)
    ]
    if images:
        inputs = processor(text=text, images=images, return_tensors="pt", **tokenize)
    else:
        inputs = tokenizer(text, return_tensors="pt", **tokenize)
    out = model.generate(
        **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
    )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def png_image(width: int, height: int, seed: int):
    """An ImageInput as the wire carries it: only bytes (the shard reads the size from them)."""
    from engine.batch import ImageInput

    return ImageInput(image_bytes(width, height, seed), "image/png")


def image_request(i: int, chunks: list, new_tokens: int):
    """Request i of text and ImageInput chunks, in order, greedy for `new_tokens`; a text-only
    prompt carries no chunks."""
    from engine.batch import Request, StoppingCriteriaParameters

    text = "".join(c for c in chunks if isinstance(c, str))
    stopping = StoppingCriteriaParameters(max_new_tokens=new_tokens, ignore_eos_token=True)
    has_images = any(not isinstance(c, str) for c in chunks)
    return Request(i, text, stopping_parameters=stopping, chunks=chunks if has_images else None)


GEMMA3_IMAGE_TOKENS = 4  # the tiny tower's 16 patches pooled 2x2
GEMMA3_NAMES = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}


def build_tiny_gemma3(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny random Gemma 3 VLM (SigLIP tower, Gemma 3 text model with sliding layers) with the
    embedded model's tokenizer (plus Gemma 3's image tokens) and its own Gemma3Processor."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(
        tokenizer_dir, extra_special_tokens=GEMMA3_NAMES
    )
    config = transformers.Gemma3Config(
        vision_config=transformers.SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE_SIZE,
            patch_size=PATCH,
        ),
        text_config=transformers.Gemma3TextConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=16,
            initializer_range=0.02,  # larger ones make this tiny model repeat one token
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.convert_tokens_to_ids(GEMMA3_NAMES["eoi_token"]),
        image_token_index=tokenizer.image_token_id,
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers starts it at zeros: the images would be read as zeros
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.1)
    model.save_pretrained(out_dir)
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        ),
        tokenizer=tokenizer,
        image_seq_length=GEMMA3_IMAGE_TOKENS,
    )
    processor.save_pretrained(out_dir)
    return out_dir


def gemma3_reference(model_dir, chunks: list, new_tokens: int, eos=False, **tokenize) -> list:
    """transformers' own Gemma 3 and Gemma3Processor (each image written as its begin-of-image
    token, which the processor expands, with token_type_ids for the image mask), greedy on one
    prompt of text pieces and image bytes in order; eos: stop at EOS (else exactly new_tokens)."""
    import transformers
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    boi = processor.tokenizer.boi_token
    text = "".join(c if isinstance(c, str) else boi for c in chunks)
    images = [
        Image.open(io.BytesIO(getattr(c, "data", c))).convert("RGB")
        for c in chunks
        if not isinstance(c, str)
    ]
    if images:
        inputs = processor(text=text, images=images, return_tensors="pt", **tokenize)
    else:
        inputs = processor.tokenizer(text, return_tensors="pt", **tokenize)
    least = {} if eos else {"min_new_tokens": new_tokens}
    out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, **least)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
