"""miaohui.compile"""
