"""Datasets for mmrl (installed as `mmrl.datasets`).

- `schema`: validation of V-Triune sample records, with errors that name file, line, id and field.
- `readers`: JSONL and Parquet readers (images as paths, bytes or base64).
- `procedural`: drawn-image kinds turned into samples (`make_samples`); the kinds live in
  `vision_reasoning` (numeric questions) and `perception` (detection, grounding, OCR, counting).
- `converters`: COCO annotations, V-Triune and EasyR1/veRL records to mmrl samples.
"""

from mmrl.datasets.readers import read_samples
from mmrl.datasets.schema import SampleError, sample_from_record

__all__ = ["SampleError", "read_samples", "sample_from_record"]
