"""The tools that measure and advise: the CLI, bench, advise, demo, and what they share.

They sit apart from the runtime (the modules directly in ``gradseam``) so that patching a model
pulls in none of them, and a tool can change without touching what runs inside a training step;
``tests/test_architecture.py`` holds both sides to it. Every tool measures through
:mod:`gradseam.tools.measure` and speaks for the model's real depth through
:mod:`gradseam.tools.depth`.
"""
