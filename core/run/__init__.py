"""The run layer: what a plan's regions become on the model, and what runs them in a step.

:mod:`~gradseam.run.install` turns each region spec into seams and chains (one runner per catalog
``runner`` name); :mod:`~gradseam.run.seams` replaces a module's ``forward`` per instance;
:mod:`~gradseam.run.chains` runs checkpoint regions and interval chunks, checked by
:mod:`~gradseam.run.links`; :mod:`~gradseam.run.scopes` opens offload groups around them;
:mod:`~gradseam.run.kernels` keeps attention kernel outputs across a recompute.
"""
