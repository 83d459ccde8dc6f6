"""``vllm-guardian diagnose`` and ``vllm-guardian plan``: a one-command incident report.

* :mod:`.bundle` reads (and writes) the incident bundle of ``docs/bundle.md``, from a directory
  or a ``.tar.gz`` extracted safely into a temporary directory;
* :mod:`.gather` collects the same files from a live host (two ``/metrics`` scrapes, ``/health``,
  GPUs, the unit, its journal, the model's ``config.json``, the daemon's recent ticks);
* :mod:`.analyze` turns a bundle into a :class:`~.report.Report` with the pure core
  (``core/signals.py``, ``core/diagnosis.py``, ``core/observations.py``, ``core/budget.py``);
* :mod:`.recommend` picks the flags to change; :mod:`.report` renders text and ``--json``.

Live mode and bundle mode share everything after gathering: a live diagnosis *is* the analysis
of the bundle it just gathered (and ``--save-bundle`` writes that bundle).
"""
