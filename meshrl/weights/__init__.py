"""Weights between meshes: versioned publishing (`publisher`), pulling a version
into a replica (`receiver`), and the checksums both sides read (`checksum`)."""
