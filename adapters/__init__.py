"""Built-in model families. Each module is a pluggy plugin listed under the ``gradseam`` entry-point group."""
