"""A module that fails while it is imported: a reward spec naming it must show this error."""

raise RuntimeError("broken on purpose")
