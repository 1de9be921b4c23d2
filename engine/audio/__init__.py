"""Audio in and out of a unit: text -> rows, voices, the codec's streaming decode, PCM.

Importing this package loads nothing heavy: the codec (transformers) and the tokenizer
(tokenizers) are imported by the modules that use them, when used."""
