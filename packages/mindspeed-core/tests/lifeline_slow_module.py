"""Imported by a lifeline test's worker: as slow to import as a module that pulls in torch on
a loaded machine, so a parent killed meanwhile must be noticed during the import."""

import time

time.sleep(60)


def init() -> None:
    pass
