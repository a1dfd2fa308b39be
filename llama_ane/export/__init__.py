from .api import export_model

__all__ = ["export_model"]
