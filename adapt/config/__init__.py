"""Run configuration: the settings dataclasses, --set values, preset files, the masked objectives' schedule and the names in a run folder."""
