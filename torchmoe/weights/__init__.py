"""Weight files read and written safely, whatever their format: a fault in a folder a user
names is one `ConfigError` (`weight_files`), DCP's pickles load without running code
(`dcp_unpickling`), every file of a DCP folder is checksummed (`checksums`), nothing non-finite
goes in or out (`finite`, `divergence`), and weights are held to the flavor they fit (`flavor_fit`).
"""
