"""Adapters for training loops stalwart does not own (issue #44): each drives the Job's step protocol
(job/step_loop.py) from the places its framework lets an integration in, and nothing else.

- `stalwart.integrations.hf`: the Hugging Face `Trainer` (transformers 5.x).

Each imports its framework only when imported itself: `import stalwart` never needs one installed.
"""
