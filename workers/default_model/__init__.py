"""The embedded default model: a ~4M-parameter Llama trained on BSD fortune files, served when no `--model` is given.

This package is data, no code: an ordinary Hugging Face checkpoint (config.json, model.safetensors
in bfloat16, tokenizer.json and tokenizer_config.json with its chat template,
generation_config.json), read by the same loader as any `--model` directory
(workers/contract/defaults.py `DEFAULT_MODEL_DIR` names it). scripts/train_default_model.py trains
it from scratch with hetserve's own model code on the English fortune cookie files of BSD `fortune`
(Debian's `fortunes-min` and `fortunes`, BSD licence); `corpus_words.txt` and `heldout_sample.txt`,
derived from that text, are what tests/test_default_model.py checks it against. The model card
(README.md here) and docs/models.md, "Embedded model", give the data, the hyper-parameters and
samples. Trade-off: a fresh install serves real text without the network, but English-looking
quips, not sense: `--model DIR` serves anything real."""
