"""remat.autodiff"""
