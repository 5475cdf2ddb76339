"""Public datasets bundled with fedpca, for the demo, examples, tests and benchmarks.

Each is a gzip-compressed CSV without a header, one record per line, the class label
(-1 or 1) in column 0 and the raw, unscaled features after it (UCI Machine Learning
Repository and LIBSVM collections, the inputs of the DPDPCA evaluation):

=============  =======  ========  ===========================================
name           records  features  notes
=============  =======  ========  ===========================================
australian         690        14  credit approval; one feature reaches 100001
diabetes           768         8  Pima Indians diabetes
german            1000        24  German credit (numeric version)
ionosphere         351        34  radar returns, features already in [-1, 1]
madelon           2000       500  NIPS 2003 feature selection, values 0..999
=============  =======  ========  ===========================================
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fedpca.errors import DataError
from fedpca.tables import OwnerTable, load_table

__all__ = ["DATASETS", "dataset_path", "load_dataset"]

DATASETS: tuple[str, ...] = ("australian", "diabetes", "german", "ionosphere", "madelon")


def dataset_path(name: str) -> Path:
    """The file of a bundled dataset (a ``.csv.gz`` that :func:`load_table` reads)."""
    if name not in DATASETS:
        raise DataError(f"no bundled dataset {name!r}; choose one of {', '.join(DATASETS)}")
    return Path(str(resources.files(__name__) / f"{name}.csv.gz"))


def load_dataset(name: str) -> OwnerTable:
    """Features (N, M) and labels (N,) of a bundled dataset."""
    return load_table(dataset_path(name), label_column=0, header=False)
