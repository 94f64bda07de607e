"""The loading wing: the official checkpoints' format, their placing on a device, and the tokenizer.

Nothing in the book (the concept files in `minillm/`) imports this folder.
"""
