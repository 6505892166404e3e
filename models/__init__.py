"""megazero's model zoo: plain, forkable GPT-2, Llama and BERT (models/gpt.py, models/llama.py,
models/bert.py) sharing their attention core and dropout (models/common.py), their Hugging Face
mappings, and `parallelize` (models/parallelize.py), which builds this rank's part
of a model for the parallel grid. See models/README.md for the contract the engine relies on.

The library (megazero/) never imports this package; the recipes, tools and tests do.
"""
