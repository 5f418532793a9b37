"""User-facing errors: one line that says what was wrong and what is accepted."""


class LinearizeError(Exception):
    """An error caused by the user's input (bad model id, missing file, empty data ...).

    The CLI prints ``linearize: error: <message>`` and exits with status 2; the message must be a
    single line that names what was wrong and what would be accepted.
    """
