"""Structured outputs: output constrained to a JSON schema, a regex, a choice or a grammar.

`spec` (torch-free: the HTTP process uses it) says what a request asks; `grammar` compiles it
with xgrammar and tracks each request's position in it; `bitmask` turns those positions into
the token masks the sampler applies. Import the submodules you need: this package imports
nothing, so the HTTP process never loads the grammar engine.
"""
