"""mmrl: reinforcement-learning post-training for multimodal models.

GRPO-family RL on vision-language models and flow-GRPO on image generators, with V-Triune-style
per-sample verifier routing. The top-level folders `verifiers/`, `rewards/` and `datasets/` are
installed as `mmrl.verifiers`, `mmrl.rewards` and `mmrl.datasets`.
"""

__version__ = "0.1.0"
