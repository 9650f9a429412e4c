"""remat.memory"""
