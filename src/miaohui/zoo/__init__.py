"""miaohui.zoo"""
