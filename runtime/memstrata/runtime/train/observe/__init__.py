"""What a run observes of itself: metrics on disk, the progress bar, memory and the device."""
