"""miaohui.server"""
