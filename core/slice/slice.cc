// Placeholder translation unit: implementation in progress.
