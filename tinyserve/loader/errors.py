"""The one error type loading raises: a single line that names the file, tensor or field at fault."""


class ModelLoadError(ValueError):
    pass
