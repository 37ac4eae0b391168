"""Vision-language models' images on the shard's side: which families are served and how many
tokens an image becomes (spec.py, shared with the router), and the encoder (encoder.py) that
preprocesses images with the model's own transformers image processor and runs the vision tower
(engine/models/llava.py) at planned image-batch shapes, warmed with the rest."""
