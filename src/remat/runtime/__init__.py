"""remat.runtime"""
