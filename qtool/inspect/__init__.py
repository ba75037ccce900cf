"""`qtool inspect`: what is this checkpoint? Header-only detection of every module's layout, with anomalies.

    from qtool.inspect import inspect_path
    report = inspect_path("model-gptq/")          # InspectReport; report.to_dict() is the --json schema
    for m in report.modules: m.name, m.scheme (format, bits, group_size, sym, desc_act), ...

Also the detection layer other commands stand on (`select`, `repack`): see detect.py.
"""

from qtool.inspect.core import inspect_path
from qtool.inspect.report import Anomaly, InspectReport, ModuleReport

__all__ = ["Anomaly", "InspectReport", "ModuleReport", "inspect_path"]
