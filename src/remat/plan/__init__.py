"""remat.plan"""
