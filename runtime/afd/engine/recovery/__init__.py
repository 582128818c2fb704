"""Keeping streams going when a peer is lost: the FFN link's care between steps, holding requests and taking back
launched steps while a lost FFN rank comes back, and requests carried over from another attention rank."""
