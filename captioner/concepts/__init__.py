"""What the encoder's heads see: the ImageNet table (ImageNet classes -> COCO categories), the category ->
words table that decoding, training and evaluation share, and class activation maps per category."""
