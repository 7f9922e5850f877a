"""Clustering math on client vectors: distances, the clustering methods, the
choice of the number of clusters and validity indices. It imports only ``errors``.
"""
