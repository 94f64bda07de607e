"""The serving wing: an OpenAI-compatible HTTP server around one engine thread, and the `serve` command.

Nothing in the book (the concept files in `minillm/`) imports this folder.
"""
