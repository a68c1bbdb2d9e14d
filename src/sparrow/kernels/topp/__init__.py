from .api import topp_select, topp_select_dense

__all__ = ["topp_select", "topp_select_dense"]
