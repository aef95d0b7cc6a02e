"""The optimizer update of each rank's shard: unscale, clip, step on the device, in host
memory or as a pipeline over files, and hand the new values to the parameters; also the
update's early window (during backward) and late one (under the next forward)."""
