"""What a researcher looks at: the static site of a pass (its data, vision pages, thumbnails), context
windows, logit attributions, `actstore show`'s pages and pictures, and a store's plots."""
