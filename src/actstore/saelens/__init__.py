"""SAELens: export a layer as the cached-activations dataset SAELens trains from, or feed its
SAETrainer straight from a store (docs/export.md, "SAELens")."""

from actstore.saelens.adapter import saelens_data_provider
from actstore.saelens.check import SaelensCheck, SaelensFolderError, verify_saelens_folder
from actstore.saelens.export import SaelensExport, SaelensExportError, export_saelens

__all__ = [
    "SaelensCheck",
    "SaelensExport",
    "SaelensFolderError",
    "verify_saelens_folder",
    "SaelensExportError",
    "export_saelens",
    "saelens_data_provider",
]
