"""remat.frontend"""
