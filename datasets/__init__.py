"""Datasets for mmrl (installed as `mmrl.datasets`).

- `schema`: validation of V-Triune sample records, with errors that name file, line, id and field.
- `readers`: JSONL and Parquet readers (images as paths, bytes or base64).
- `vision_reasoning`: the built-in procedural visual-reasoning task.
"""

from mmrl.datasets.readers import read_samples
from mmrl.datasets.schema import SampleError, sample_from_record

__all__ = ["SampleError", "read_samples", "sample_from_record"]
