"""Vision-language models: which families are served and how many tokens an image becomes
(spec.py, shared with the router), the model's own image processor (preprocess.py), and the
vision tower run at planned image-batch shapes beside the language model (tower.py)."""
