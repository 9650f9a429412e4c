"""remat.backends"""
